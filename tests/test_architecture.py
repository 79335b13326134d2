"""The shape of the source tree, as a specification: imports run one way, no module imports itself back, no file
grows past 400 lines.

The import graph is read with ``ast`` from the source files (every ``import``, also those inside functions and
``TYPE_CHECKING`` blocks: a lazy import is still a dependency). Each package of the engine has a floor; a module may
import its own floor and the floors below it, never one above. Floors are listed top first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "pagoda": REPO / "engine" / "src" / "pagoda",
    "pagoda_kernels": REPO / "kernels" / "src" / "pagoda_kernels",
    "pagoda_operator": REPO / "operator" / "src" / "pagoda_operator",
}
BENCHMARKS = REPO / "benchmarks"
MAX_SOURCE_LINES = 400

# The engine's floors, top first. A module belongs to the floor of the longest prefix that names it.
ENGINE_FLOORS: tuple[tuple[str, ...], ...] = (
    # the public facade (lazy exports), the command line and test-only helpers that no engine module imports
    ("pagoda", "pagoda.cli", "pagoda.cli_serve", "pagoda.cli_models", "pagoda.testing", "pagoda.vllm_flags"),
    # the OpenAI server and the offline LLM class
    ("pagoda.entrypoints",),
    ("pagoda.metrics",),
    # LLMEngine: scheduler, LoRA registry, output processing; the pooling engine (embeddings, scores: no KV cache)
    ("pagoda.engine", "pagoda.pooling"),
    # Executor: one process or several; owns the worker processes, their death listeners and shutdown
    ("pagoda.executor",),
    # one Worker per rank and its ModelRunner (tensors, KV cache, sampler, LoRA device slots)
    ("pagoda.worker",),
    ("pagoda.loader",),
    ("pagoda.models",),
    ("pagoda.lora",),
    ("pagoda.layers",),
    ("pagoda.quantization",),
    # the attention protocol and its backends
    ("pagoda.attention",),
    ("pagoda.distributed",),
    ("pagoda.core",),
    # plain data: requests, outputs, sampling and grammar parameters, tokenizers
    ("pagoda.request", "pagoda.outputs", "pagoda.sampling_params", "pagoda.structured_output", "pagoda.tokenizer"),
    # what the engine is configured with: options, the capability contract, model configs and sources
    (
        "pagoda.options",
        "pagoda.config",
        "pagoda.capabilities",
        "pagoda.model_config",
        "pagoda.model_overrides",
        "pagoda.kv_events_config",
        "pagoda.model_source",
        "pagoda.confined_paths",
        "pagoda.startup_failure",
    ),
    # the ground floor: native kernels and their loading, CPU features, the package version
    ("pagoda.cpu", "pagoda.kernel_loading", "pagoda.version"),
)


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    modules = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            modules[_module_name(path, root, package)] = path
    return modules


def _imported_names(module: str, path: Path) -> Iterable[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import submodule` depends on the submodule, `from module import name` on the module:
            # the qualified name resolves to the longest prefix that is a module
            yield from (f"{target}.{alias.name}" for alias in node.names)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (a name resolves to the longest module prefix)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def benchmark_graph() -> dict[str, set[str]]:
    """The benchmarks folder is not a package: its scripts import each other by bare module name."""
    scripts = {path.stem: path for path in BENCHMARKS.rglob("*.py")}
    graph = {}
    for name, path in scripts.items():
        imported = {imported.split(".")[0] for imported in _imported_names(name, path)}
        graph[name] = {other for other in scripts if other != name and other in imported}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# The operator's floors, top first (same rules).
OPERATOR_FLOORS: tuple[tuple[str, ...], ...] = (
    ("pagoda_operator",),
    # the request router (`python -m pagoda_operator.router`): its server modules over its routing core (one floor,
    # imports inside it run server -> core only); it uses the Kubernetes client, pod readiness and the shared names
    ("pagoda_operator.router",),
    # `python -m pagoda_operator.run`: Lease leader election around the kopf handlers
    ("pagoda_operator.run",),
    # the kopf registrations (`kopf run -m pagoda_operator.main`)
    ("pagoda_operator.main",),
    # what acts on the cluster: the reconciler, the built-in autoscaler, the Deployment watch, the Lease
    (
        "pagoda_operator.reconcile",
        "pagoda_operator.autoscaler",
        "pagoda_operator.child_watch",
        "pagoda_operator.leader",
    ),
    # the status computed from what was observed, with the adapter and ignored-scale parts it puts together
    ("pagoda_operator.status",),
    ("pagoda_operator.lora_status", "pagoda_operator.scale_status"),
    # pure: a spec into its children's manifests, and the engine's capability contract
    ("pagoda_operator.builders", "pagoda_operator.capabilities"),
    # the Kubernetes API client and its login
    ("pagoda_operator.kube",),
    ("pagoda_operator.kube_config",),
    # plain data: the validated spec, pod readiness, status conditions
    ("pagoda_operator.spec", "pagoda_operator.pods", "pagoda_operator.conditions"),
    # spec.routing and autoscaling.keda, parsed (below spec, which holds them), and InvalidSpec under both
    ("pagoda_operator.spec_routing",),
    ("pagoda_operator.spec_errors",),
    # the ground floor: names and defaults, the package version
    ("pagoda_operator.constants", "pagoda_operator.version"),
)

# The kernels' floors, top first (same rules).
KERNEL_FLOORS: tuple[tuple[str, ...], ...] = (
    # the package root: the version only (kernel modules import Triton and are imported one by one)
    ("pagoda_kernels",),
    # the kernels, each next to its plain-torch reference
    (
        "pagoda_kernels.activation",
        "pagoda_kernels.decode_attention",
        "pagoda_kernels.extend_attention",
        "pagoda_kernels.fp8_gemm",
        "pagoda_kernels.fused_moe",
        "pagoda_kernels.int_gemm",
        "pagoda_kernels.kv_write",
        "pagoda_kernels.lora",
        "pagoda_kernels.rms_norm",
        "pagoda_kernels.rotary",
    ),
    # the weight-quantized GEMM kernel behind int_gemm and fp8_gemm, its split-K reduction and its launch
    ("pagoda_kernels.quant_gemm",),
    # Triton pieces several kernels share: GEMM tile choice, weight-tile dequantization, the KV cache's FP8 codes
    (
        "pagoda_kernels.gemm_tiles",
        "pagoda_kernels.weight_tiles",
        "pagoda_kernels.fp8_codes",
        "pagoda_kernels.attention_logits",
    ),
    # host-side helpers (the host-wrapper pattern, strides, dot precision, SM count); no Triton
    ("pagoda_kernels.host",),
)

FLOORS = {"pagoda": ENGINE_FLOORS, "pagoda_operator": OPERATOR_FLOORS, "pagoda_kernels": KERNEL_FLOORS}


def floor_of(module: str) -> int:
    """The floor number of a module of any of the three packages (0 is the top)."""
    root = module.split(".")[0]
    best, floor = "", None
    for number, prefixes in enumerate(FLOORS[root]):
        for prefix in prefixes:
            matches = module == prefix or (prefix != root and module.startswith(prefix + "."))
            if matches and len(prefix) > len(best):
                best, floor = prefix, number
    assert floor is not None, f"{module} is on no floor: add it to the floors of {root}"
    return floor


def engine_floor(module: str) -> int:
    assert module.split(".")[0] == "pagoda", module
    return floor_of(module)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(source_modules())


def test_no_import_circle_in_the_source_packages(graph: dict[str, set[str]]) -> None:
    assert circles(graph) == []


def test_no_import_circle_among_the_benchmarks() -> None:
    assert circles(benchmark_graph()) == []


def test_every_module_is_on_a_floor(graph: dict[str, set[str]]) -> None:
    for module in graph:
        floor_of(module)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to one on a higher floor of the same package."""
    return [
        f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if target.split(".")[0] == module.split(".")[0] and floor_of(target) < floor_of(module)
    ]


def test_imports_run_downward(graph: dict[str, set[str]]) -> None:
    assert upward_imports(graph) == []


# The engine drives the model through the executor's interface only: never a rank's worker, runner or LoRA slots,
# never an executor implementation or its processes.
BEHIND_THE_EXECUTOR = (
    "pagoda.worker.worker",
    "pagoda.worker.model_runner",
    "pagoda.lora.slots",
    "pagoda.executor.uniproc",
    "pagoda.executor.multiproc",
    "pagoda.executor.worker_group",
    "pagoda.executor.worker_process",
)


def test_the_engine_reaches_the_model_only_through_the_executor(graph: dict[str, set[str]]) -> None:
    reaching = [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if module.startswith(("pagoda.engine", "pagoda.entrypoints", "pagoda.metrics", "pagoda.cli"))
        for target in sorted(targets)
        if any(target == hidden or target.startswith(hidden + ".") for hidden in BEHIND_THE_EXECUTOR)
    ]
    assert reaching == []


def test_test_utilities_are_never_imported_by_the_engine(graph: dict[str, set[str]]) -> None:
    importers = [
        module
        for module, targets in graph.items()
        if not module.startswith("pagoda.testing") and any(t.startswith("pagoda.testing") for t in targets)
    ]
    assert importers == []


def test_the_operator_never_imports_torch_or_the_engine() -> None:
    for module, path in source_modules().items():
        if module.startswith("pagoda_operator"):
            roots = {name.split(".")[0] for name in _imported_names(module, path)}
            assert not roots & {"torch", "pagoda", "pagoda_kernels"}, module


def test_no_source_file_is_over_400_lines() -> None:
    sources = [REPO / "engine" / "src", REPO / "kernels" / "src", REPO / "operator" / "src"]
    too_long = {
        str(path.relative_to(REPO)): count
        for root in sources
        for path in sorted(root.rglob("*"))
        if path.suffix in {".py", ".cpp", ".h"}
        and (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_SOURCE_LINES
    }
    assert too_long == {}


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    """The checker itself: a two-module circle is found, and an import from a low floor to a high one is upward."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert engine_floor("pagoda.cpu.cpu_features") > engine_floor("pagoda.engine.llm_engine")
    assert engine_floor("pagoda") == 0
