"""The built-in autoscaler (``autoscaling.mode: builtin``): a pure algorithm, a metrics scraper and the kopf glue."""

from pagoda_operator.autoscaler.algorithm import AutoscalerState, Decision, EngineMetrics, PodSample, decide

__all__ = ["AutoscalerState", "Decision", "EngineMetrics", "PodSample", "decide"]
