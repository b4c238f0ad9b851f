"""The continuous-batching core gives each row the logits it would get alone, as rows join and leave."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from node_host.backends.torch_engine.batch import DecodeBatch, prefill, sample  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


def alone(model, ids: list[int]) -> torch.Tensor:
    """Reference: next-token logits from one uncached forward over the whole sequence."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_rows_join_and_leave_without_changing_each_others_logits(model):
    # Tokens are fed in, not sampled: the random model repeats itself, which would hide mix-ups.
    seqs = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12, 13, 14, 15, 16, 17], "c": [20, 21]}
    feeds = {"a": [30, 31, 32, 33, 34, 35], "b": [40, 41, 42, 43], "c": [50, 51, 52]}
    batch = DecodeBatch(CPU)
    rows: list[str] = []

    def join(name: str) -> None:
        first = prefill(model, seqs[name], CPU)
        assert torch.allclose(first.logits, alone(model, seqs[name]), atol=1e-4)
        batch.add(first)
        rows.append(name)

    def step() -> None:
        tokens = [feeds[name].pop(0) for name in rows]
        for name, token in zip(rows, tokens):
            seqs[name].append(token)
        logits = batch.step(model, tokens)
        for i, name in enumerate(rows):
            assert torch.allclose(logits[i], alone(model, seqs[name]), atol=1e-4), name

    join("a")
    step()
    join("b")  # longer than the batch: the batch is padded on the left
    step()
    join("c")  # shorter: the newcomer is padded
    step()
    batch.keep([1, 2])  # "a" leaves
    rows.remove("a")
    step()
    batch.keep([0])  # "c" leaves; the longest row remains and padding columns are trimmed
    rows.remove("c")
    assert batch.columns == len(seqs["b"])
    step()


@pytest.mark.parametrize(
    "temps, top_p, expect",
    [
        ([0.0, 0.0], [1.0, 1.0], [2, 0]),  # greedy
        ([1.0, 0.0], [1e-6, 1.0], [2, 0]),  # top_p that keeps only the best token is greedy too
    ],
)
def test_sample(temps, top_p, expect):
    logits = torch.tensor([[0.0, 1.0, 5.0], [3.0, 1.0, 0.0]])
    assert sample(logits, temps, top_p, torch.Generator().manual_seed(0)) == expect


def test_sample_is_seeded():
    logits = torch.zeros((4, 50))
    draw = [sample(logits, [1.0] * 4, [1.0] * 4, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert draw[0] == draw[1]
    assert len(set(sample(logits, [1.0] * 4, [1.0] * 4, torch.Generator().manual_seed(s))[0] for s in range(20))) > 1


NAN, INF = float("nan"), float("inf")
ROWS = torch.tensor([[0.0, 1.0, 5.0], [3.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "temps, top_p, expect",
    [
        # top_p 0 keeps the most likely token (SGLang's and vLLM's sampler keep it too): greedy, not an empty
        # distribution that torch.multinomial refuses for the whole batch
        ([1.0, 1.0], [0.0, 0.0], [2, 0]),
        ([1.0, 0.0], [0.0, 1.0], [2, 0]),
        # a temperature below 1e-5 is greedy (vLLM's rule): dividing by 1e-40 gave inf, softmax NaN
        ([1e-40, 1e-40], [1.0, 1.0], [2, 0]),
        ([1e-6, 0.0], [0.5, 1.0], [2, 0]),
        # not numbers at all (the engine takes SamplingParams from any caller): greedy / all kept
        ([NAN, 0.0], [1.0, 1.0], [2, 0]),
        ([1e-40, 0.0], [NAN, 1.0], [2, 0]),
    ],
)
def test_sample_parameters_that_used_to_fail_the_batch_are_decided_per_row(temps, top_p, expect):
    assert sample(ROWS, temps, top_p, torch.Generator().manual_seed(0)) == expect


@pytest.mark.parametrize(
    "broken",
    [[NAN, 0.0, 1.0], [INF, 0.0, 1.0], [-INF, -INF, -INF]],
    ids=["nan", "inf", "all-minus-inf"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_non_finite_logits_gets_none_and_the_other_rows_their_tokens(broken, temperature):
    logits = torch.tensor([[0.0, 1.0, 5.0], broken, [3.0, 1.0, 0.0]])
    got = sample(logits, [0.0, temperature, 0.0], [1.0, 0.5, 1.0], torch.Generator().manual_seed(0))
    assert got == [2, None, 0]


def test_huge_logits_and_a_small_temperature_still_sample_a_real_token():
    """Shifted by the row's maximum before the division, so a large logit over a small temperature is
    never inf - inf."""
    logits = torch.tensor([[3e38, 1e38, -3e38, -INF]])
    assert sample(logits, [2e-5], [1.0], torch.Generator().manual_seed(0)) == [0]


def test_one_rows_parameters_do_not_change_the_other_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    alone = [sample(logits[i : i + 1], [0.0], [1.0], torch.Generator().manual_seed(0))[0] for i in range(4)]
    mixed = sample(logits, [0.0, 1e-40, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0], torch.Generator().manual_seed(0))
    assert mixed == alone  # rows 1 and 3 are greedy too, by their own parameters
