import pytest

from sie.requirements import unmet_requirements

FACTS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.4", "sglang": "0.5.23", "vllm": None}


@pytest.mark.parametrize(
    "requires, unmet, fragments",
    [
        ([], 0, []),
        (["cuda>=12.1"], 0, []),
        (["cuda>=12.1", "sglang==0.5.*", "torch>=2.4,<3"], 0, []),
        (["SGLang==0.5.*"], 0, []),  # names fold case
        (["torch"], 0, []),  # a bare name asks only for presence
        (["cuda>=12.6"], 1, ["requires 'cuda>=12.6'", "node has cuda 12.4"]),
        (["sglang==0.4.*"], 1, ["node has sglang 0.5.23"]),
        (["vllm>=0.6"], 1, ["does not report vllm"]),  # None means not installed
        (["tensorrt>=10"], 1, ["does not report tensorrt", "install tensorrt"]),
        (["cuda>=12.1", "tensorrt"], 1, ["does not report tensorrt"]),
        (["cuda<12"], 1, ["node has cuda 12.4"]),
    ],
)
def test_constraints_against_node_facts(requires, unmet, fragments):
    reasons = unmet_requirements(requires, FACTS)
    assert len(reasons) == unmet
    for fragment in fragments:
        assert fragment in " ".join(reasons)


def test_every_unmet_constraint_gets_its_own_reason():
    reasons = unmet_requirements(["cuda>=13", "sglang==0.4.*", "vllm"], FACTS)
    assert len(reasons) == 3
    assert "cuda" in reasons[0] and "sglang" in reasons[1] and "vllm" in reasons[2]


def test_a_fact_that_is_not_a_version_is_reported_not_crashed_on():
    reasons = unmet_requirements(["cuda>=12"], {"cuda": "unknown"})
    assert reasons == ("the spec requires 'cuda>=12' but the node reports cuda as 'unknown', which is not a version",)


def test_prerelease_node_versions_are_compared_not_rejected():
    assert unmet_requirements(["torch>=2.5"], {"torch": "2.6.0.dev20250101"}) == ()
