"""Every ``vllm:*`` series the operator, the chart (dashboard, prometheus-adapter rules, HPA) and the CRD name is
one the engine exports: a dashboard panel or an autoscaler on a name the engine does not serve fails silently."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parent.parent
# Where metric names are written for consumers of the engine's /metrics.
CONSUMERS = [
    *sorted((ROOT / "charts").rglob("*.yaml")),
    *sorted((ROOT / "charts").rglob("*.json")),
    *sorted((ROOT / "charts").rglob("*.tpl")),
    *sorted((ROOT / "crds").rglob("*.yaml")),
    *sorted((ROOT / "operator" / "src").rglob("*.py")),
]
NAME = re.compile(r"vllm:[a-z_:]+[a-z]")


def exported_series() -> set[str]:
    """Every series name in the engine's exposition (counters with ``_total``, histograms' ``_bucket`` ...), LoRA on
    (``vllm:lora_requests_info`` exists only then)."""
    metrics = EngineMetrics("m", block_size=16, num_blocks=64, max_model_len=256, max_loras=2)
    text = generate_latest(metrics.registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_the_engine_exports_the_series_everyone_else_names():
    exported = exported_series()
    assert "vllm:num_requests_waiting" in exported  # the scaling metric itself
    named = {(path.relative_to(ROOT).as_posix(), name) for path in CONSUMERS for name in NAME.findall(path.read_text())}
    assert named, "no consumer names any vllm:* series: the scan is broken"
    missing = sorted((path, name) for path, name in named if name not in exported)
    assert not missing, f"series the engine does not export: {missing}"


def test_the_autoscaler_reads_a_real_engine_exposition():
    from pagoda_operator.autoscaler.scrape import parse_metrics

    metrics = EngineMetrics("m", block_size=16, num_blocks=64, max_model_len=256)
    metrics.num_requests_waiting.labels(model_name="m").set(5)
    metrics.num_requests_running.labels(model_name="m").set(2)
    parsed = parse_metrics(generate_latest(metrics.registry).decode(), "m")
    assert parsed is not None and (parsed.waiting, parsed.running) == (5.0, 2.0)
    assert parse_metrics("this is not prometheus text {{{", "m") is None
