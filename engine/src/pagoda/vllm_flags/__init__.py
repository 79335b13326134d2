"""``vllm serve`` compatibility of ``pagoda serve``: the table of vLLM's flags and what each means here
(:mod:`.table`), the flags Pagoda declares only for vLLM command lines (:mod:`.apply`), and ``--config FILE``
(:mod:`.config_file`). docs/vllm-compatibility.md is the same table in prose."""

from pagoda.vllm_flags.apply import add_vllm_args, apply_vllm_args
from pagoda.vllm_flags.config_file import expand_config_file
from pagoda.vllm_flags.table import VLLM_FLAGS, VllmFlag, flag_table

__all__ = ["VLLM_FLAGS", "VllmFlag", "add_vllm_args", "apply_vllm_args", "expand_config_file", "flag_table"]
