from types import SimpleNamespace

import pytest

from node_host.gpus import MIB, GPUInventoryError, inventory, node_facts, parse_virtual_gpus, process_memory


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The few pynvml functions the inventory calls, over a declared list of devices."""

    NVMLError = FakeNVMLError

    def __init__(self, devices, *, init_fails=False, cuda_driver=12040):
        self.devices = devices
        self.init_fails = init_fails
        self.cuda_driver = cuda_driver
        self.open_sessions = 0

    def nvmlInit(self):
        if self.init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.open_sessions += 1

    def nvmlShutdown(self):
        self.open_sessions -= 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def nvmlDeviceGetName(self, handle):
        return handle["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=handle["total"], used=handle["used"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle.get("util") is None:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get("procs", [])]

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda_driver


A100 = {
    "name": "NVIDIA A100-SXM4-80GB",
    "total": 81920 * MIB,
    "used": 2048 * MIB,
    "util": 37,
    "procs": [(4242, 1500 * MIB), (4243, None)],
}
MIG = {"name": b"NVIDIA A100 MIG 3g.40gb", "total": 40960 * MIB, "used": 0, "util": None}


@pytest.mark.parametrize(
    "text, totals",
    [
        ("2x80GB", [81920, 81920]),
        ("1x24GB,1x48GB", [24576, 49152]),
        ("4x81920MB", [81920] * 4),
        ("1x0.5GB", [512]),
        (" 2 x 16 GiB ", [16384, 16384]),
        ("3*1G", [1024] * 3),
    ],
)
def test_virtual_gpus_parse(text, totals):
    gpus = parse_virtual_gpus(text)
    assert [g.total_mb for g in gpus] == totals
    assert [g.index for g in gpus] == list(range(len(totals)))
    assert all(g.virtual and "virtual" in g.name and g.used_mb == 0 and g.utilization is None for g in gpus)


@pytest.mark.parametrize("text", ["", "80GB", "2x80", "2x80TB", "x80GB", "0x80GB", "2x0GB", "2x80GB;1x40GB"])
def test_virtual_gpus_refuse_what_they_cannot_read(text):
    with pytest.raises(GPUInventoryError) as err:
        parse_virtual_gpus(text)
    assert "2x80GB" in str(err.value)  # the message shows the form that works


def test_inventory_prefers_the_declared_virtual_gpus():
    nvml = FakeNVML([A100])
    gpus = inventory("1x24GB", nvml=nvml)
    assert [(g.total_mb, g.virtual) for g in gpus] == [(24576, True)]
    assert nvml.open_sessions == 0


def test_inventory_reads_nvml():
    nvml = FakeNVML([A100, MIG])
    gpus = inventory(None, nvml=nvml)
    assert [(g.index, g.name, g.total_mb, g.used_mb, g.utilization, g.virtual) for g in gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", 81920, 2048, 0.37, False),
        (1, "NVIDIA A100 MIG 3g.40gb", 40960, 0, None, False),  # bytes names decoded; no utilisation: unknown
    ]
    assert nvml.open_sessions == 0  # every nvmlInit was matched by nvmlShutdown


def test_inventory_without_a_driver_points_at_virtual_gpus():
    nvml = FakeNVML([], init_fails=True)
    with pytest.raises(GPUInventoryError, match="--virtual-gpus"):
        inventory(None, nvml=nvml)


def test_process_memory_lists_each_process_per_gpu():
    procs = process_memory(nvml=FakeNVML([A100, MIG]))
    assert [(p.gpu_index, p.pid, p.used_mb) for p in procs] == [(0, 4242, 1500), (0, 4243, None)]


@pytest.mark.parametrize(
    "versions, torch_cuda, driver, expected",
    [
        (
            {"torch": "2.13.0+cu124", "sglang": "0.5.23"},
            "12.4",
            12080,
            {"torch": "2.13.0", "sglang": "0.5.23", "cuda": "12.4"},
        ),
        ({"torch": "2.13.0+cpu"}, None, 12080, {"torch": "2.13.0", "cuda": "12.8"}),  # CPU torch: the driver's CUDA
        ({"torch": "2.13.0"}, None, None, {"torch": "2.13.0"}),  # no driver either: no cuda fact at all
        ({}, "12.4", None, {}),  # torch absent: its CUDA is not asked for
        ({"vllm": "0.6.3"}, None, 11080, {"vllm": "0.6.3", "cuda": "11.8"}),
    ],
)
def test_node_facts(versions, torch_cuda, driver, expected):
    nvml = FakeNVML([], init_fails=driver is None, cuda_driver=driver or 0)
    facts = node_facts(nvml=nvml, version_of=versions.get, torch_cuda=lambda: torch_cuda)
    assert facts.pop("python").count(".") == 2
    assert facts == expected
