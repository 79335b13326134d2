"""Pagoda under the CPU-comparison protocol (see protocol.py), in-process through the LLM API.

A quantized checkpoint (AWQ, GPTQ: ``quantization_config`` in its config.json) is served with the engine's
defaults, which infer the method from the checkpoint; ``--quantization int8`` quantizes a float one on load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import protocol  # noqa: E402


def checkpoint_quantization(model_dir: str) -> Optional[str]:
    """The quantization method a checkpoint's config.json declares (``quant_method``), or None."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def main() -> None:
    args = protocol.parse_args(
        lambda p: p.add_argument("--quantization", default=None, choices=["int8"], help="weight-only int8")
    )
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import pagoda
    from pagoda import LLM, SamplingParams

    workload = protocol.load_workload(args.workload)
    max_batch = max([case["batch"] for case in workload["decode"]] + [1])
    method = args.quantization or checkpoint_quantization(args.model)
    protocol.progress(f"loading {args.model} (bf16, quantization={method})")
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        quantization=args.quantization,
        max_num_seqs=max(max_batch, 1),
        enable_prefix_caching=False,  # prompts repeat across timed runs: measure real prefill every time
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)

    measured = protocol.measure(generate, workload)
    system = "pagoda" if method is None else f"pagoda {method}"
    protocol.write_result(args.out, system, pagoda.__version__, measured, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
