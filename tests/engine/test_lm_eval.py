"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through `pagoda serve` (its ``local-completions``
model: echo, logprobs, ``max_tokens`` 1) exactly as through transformers (its ``hf`` model) on the same checkpoint:
the same loglikelihood for every request, the same accuracy. No network: the task and its data are local files."""

from __future__ import annotations

import json

import pytest
from server_helpers import start_server

pytestmark = pytest.mark.slow  # a real server process and two harness runs

CHECKPOINT = "/work/shared/models/stories260K"
TASK = "pagoda_tiny_stories_mc"
TOLERANCE = 1e-4
# A dozen story openings with a right ending among wrong ones (the tiny model gets some right, not all).
DOCS = [
    ("Once upon a time, there was a little", [" girl", " table", " seven"], 0),
    ("One day, Lily went to the", [" park", " yesterday", " blue"], 0),
    ("She was very", [" happy", " door", " under"], 0),
    ("Tom and his mom went to the", [" store", " happy", " jumped"], 0),
    ("The sun was shining and the birds were", [" singing", " spoon", " car"], 0),
    ("He wanted to play with his", [" ball", " sad", " the"], 0),
    ("They had a lot of", [" fun", " went", " red"], 0),
    ("The little dog wagged its", [" tail", " cloud", " book"], 2),
    ('Lily said, "Thank', [" you", " tree", " cat"], 0),
    ("At night, the moon was", [" bright", " running", " apple"], 1),
    ("Ben saw a big red", [" ball", " sleep", " quickly"], 0),
    ("After lunch, they took a", [" nap", " green", " loud"], 0),
]


def write_task(folder) -> None:
    """The task YAML over a local JSON-lines file, as a harness user would write it."""
    data = folder / "docs.jsonl"
    with data.open("w") as f:
        for context, choices, answer in DOCS:
            f.write(json.dumps({"context": context, "choices": choices, "answer": answer}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )


@pytest.fixture(scope="module")
def server():
    server = start_server(CHECKPOINT, "--max-model-len", "256")
    yield server
    server.stop()


def evaluate(model: str, model_args: dict, folder) -> tuple[float, list[tuple[int, list[float]]]]:
    """(accuracy, each doc's loglikelihood per choice) of one harness run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(folder)),
        batch_size=4,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [(s["doc_id"], [float(resp[0]) for resp in s["filtered_resps"]]) for s in samples]
    return results["results"][TASK]["acc,none"], loglikelihoods


def test_local_completions_scores_as_the_hf_model_does(server, tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_task(tmp_path)
    served = {
        "base_url": f"{server.base_url}/completions",
        "model": CHECKPOINT,
        "tokenizer": CHECKPOINT,
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
        "add_bos_token": True,  # both models score the same tokens: <s>, the context, the continuation
    }
    served_acc, served_lls = evaluate("local-completions", served, tmp_path)
    hf_acc, hf_lls = evaluate(
        "hf", {"pretrained": CHECKPOINT, "dtype": "float32", "device": "cpu", "add_bos_token": True}, tmp_path
    )
    assert len(served_lls) == len(DOCS) and [doc for doc, _ in served_lls] == [doc for doc, _ in hf_lls]
    for (doc, served_doc), (_, hf_doc) in zip(served_lls, hf_lls):
        assert len(served_doc) == len(hf_doc) == 3
        assert max(abs(a - b) for a, b in zip(served_doc, hf_doc)) < TOLERANCE, (doc, served_doc, hf_doc)
    assert served_acc == hf_acc
    assert 0.0 < hf_acc < 1.0  # neither all right nor all wrong: a wrong loglikelihood would show
