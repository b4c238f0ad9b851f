"""The NVML reader, against a fake NVML: absent (None) whenever NVML cannot answer."""

from types import SimpleNamespace

import pytest

from sidecar.gpu import GpuSample, open_nvml


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, init_fails=False, gpus=1, read_fails=False):
        self.init_fails, self.gpus, self.read_fails, self.shutdowns = init_fails, gpus, read_fails, 0

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= self.gpus:
            raise self.NVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.read_fails:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(gpu=42, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)


def test_reads_utilisation_and_memory():
    reader = open_nvml(0, FakeNvml())
    assert reader.read() == GpuSample(0.42, 3072.0, 81920.0)


@pytest.mark.parametrize("nvml, index", [(FakeNvml(init_fails=True), 0), (FakeNvml(gpus=1), 3)])
def test_unavailable_nvml_gives_no_reader(nvml, index):
    assert open_nvml(index, nvml) is None


def test_a_failing_read_is_absent_not_zero():
    nvml = FakeNvml(read_fails=True)
    reader = open_nvml(0, nvml)
    assert reader.read() is None
    reader.close()
    assert nvml.shutdowns == 1
