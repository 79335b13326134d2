"""Pagoda under the CPU-comparison protocol (see protocol.py), in-process through the LLM API."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import protocol  # noqa: E402


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
    protocol.progress(f"loading {args.model} (bf16, quantization={args.quantization})")
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
    system = "pagoda" if args.quantization is None else f"pagoda {args.quantization}"
    protocol.write_result(args.out, system, pagoda.__version__, measured, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
