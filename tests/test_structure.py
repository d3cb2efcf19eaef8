"""The package's import graph has no cycles: every import statement counts, deferred ones (inside functions)
and ``TYPE_CHECKING`` ones included, over ``tim_megatron/`` and ``patches/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(roots: tuple[str, ...] = ("tim_megatron", "patches")) -> dict[str, set[str]]:
    """Module -> the package modules it imports. ``from pkg import sub`` depends on ``pkg.sub`` when that is a
    module, on ``pkg`` (its ``__init__``) otherwise; an import of a name deeper than a module resolves to the
    module that holds it."""
    files = {_name(p): p for r in roots for p in (ROOT / r).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                for a in node.names:
                    wanted.add(f"{module}.{a.name}" if f"{module}.{a.name}" in files else module)
        deps = set()
        for w in wanted:
            while w and w not in files:
                w = w.rpartition(".")[0]
            if w and w != name:
                deps.add(w)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_checker_finds_a_cycle_and_reads_from_imports_right():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "tim_megatron.gpu_check.compare" in graph["tim_megatron.gpu_check.sections"]  # from pkg import sub
    assert "tim_megatron.recipe.schema" in graph["tim_megatron.trainer.families.base"]  # module level
    assert "tim_megatron.slurm.render" in graph["tim_megatron.slurm.submit"]
    assert len(graph) > 100


def test_no_import_cycles():
    assert cycles(import_graph()) == []


COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
}
TENSOR_MAKERS = {"tensor", "zeros", "ones", "empty", "full", "arange"}


def tensors_reduced_without_a_device(source: str) -> list[str]:
    """``function:line`` of each tensor built by ``torch.<maker>(...)`` without ``device=`` that a function passes to
    a ``dist`` collective (NCCL refuses CPU tensors: issue 62, item 3). A name assigned anything else (``.to(...)``,
    another tensor) counts as placed."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        unplaced: dict[str, int] = {}
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                v, name = node.value, node.targets[0].id
                bare = (
                    isinstance(v, ast.Call)
                    and isinstance(v.func, ast.Attribute)
                    and v.func.attr in TENSOR_MAKERS
                    and isinstance(v.func.value, ast.Name)
                    and v.func.value.id == "torch"
                    and not any(k.arg == "device" for k in v.keywords)
                )
                if bare:
                    unplaced.setdefault(name, node.lineno)
                else:
                    unplaced.pop(name, None)
        for node in ast.walk(fn):
            call = node if isinstance(node, ast.Call) else None
            if (
                call is not None
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in COLLECTIVES
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "dist"
                and call.args
                and isinstance(call.args[0], ast.Name)
                and call.args[0].id in unplaced
            ):
                out.append(f"{fn.name}:{unplaced[call.args[0].id]}")
    return out


def test_every_tensor_sent_to_a_collective_is_made_on_the_collectives_device():
    """Issue 62, item 3: NCCL takes CUDA tensors only, so a CPU tensor built for an all-reduce works under gloo (every
    CPU test) and fails on the first multi-GPU step. Every tensor the package builds for a collective names its
    device (tim_megatron/comm.py's comm_device); the scanner finds planted ones."""
    planted = (
        "def counts(group):\n"
        "    c = torch.tensor([1.0, 2.0], dtype=torch.float64)\n"
        "    dist.all_reduce(c, group=group)\n"
        "def placed(group):\n"
        "    c = torch.tensor([1.0], device=comm_device(group))\n"
        "    dist.all_reduce(c, group=group)\n"
        "def moved(group):\n"
        "    ok = torch.ones(1)\n"
        "    ok = ok.to(device)\n"
        "    dist.all_reduce(ok)\n"
        "def flags():\n"
        "    f = torch.zeros(4)\n"
        "    f[0] = 1.0\n"
        "    dist.all_reduce(f, op=dist.ReduceOp.MAX)\n"
    )
    assert tensors_reduced_without_a_device(planted) == ["counts:2", "flags:12"]
    found = [
        f"{p.relative_to(ROOT)}:{hit}"
        for p in sorted((ROOT / "tim_megatron").rglob("*.py"))
        for hit in tensors_reduced_without_a_device(p.read_text())
    ]
    assert found == []
