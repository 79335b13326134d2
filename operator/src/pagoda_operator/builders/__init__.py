"""Pure functions from a validated spec and its owner to the child objects' manifests (plain dicts)."""

from pagoda_operator.builders.children import build_children
from pagoda_operator.builders.deployment import build_deployment, engine_args, replicas_apply
from pagoda_operator.builders.disruption import build_pdb
from pagoda_operator.builders.hpa import build_hpa
from pagoda_operator.builders.lora import build_lora_config_map, lora_config_map_name
from pagoda_operator.builders.meta import Owner, child_labels, selector_labels, selector_string
from pagoda_operator.builders.service import build_service

__all__ = [
    "Owner",
    "build_children",
    "build_deployment",
    "build_hpa",
    "build_lora_config_map",
    "build_pdb",
    "build_service",
    "child_labels",
    "engine_args",
    "lora_config_map_name",
    "replicas_apply",
    "selector_labels",
    "selector_string",
]
