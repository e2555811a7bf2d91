"""The project's import graph has no circle (issue #50 item 3), and protocol/ stays the pure layer.

The graph is read from the source with `ast`, not by importing: every `import` and `from ... import`
in `peer/`, `protocol/` and `bootstrap/` counts, at module level or inside a function alike (a
function-level import is an edge too, taken later). `from pkg import name` is an edge to `pkg.name`
when that is a module of ours, else to `pkg`; relative imports are resolved against the importing
module's package. Imports under `if TYPE_CHECKING:` never run, yet they tie two modules together all
the same: they count for the two cycle checks and are left out of the others.

Checks:
- no cycle between modules, type-only imports included (the cycle is printed);
- no cycle between the folders of peer/ (train, sync, state, pipeline, round, net, ...), type-only
  imports included;
- peer/train/ imports nothing from peer/state/;
- no function-level import of the project's own modules, except those in FUNCTION_LEVEL_ALLOWED;
- every module under protocol/ imports without hivemind or click (in a subprocess whose
  `sys.meta_path` refuses them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("peer", "protocol", "bootstrap")

# (importing module, imported module) -> why the import stays inside a function. Only where the
# imported module pulls a heavy dependency the importing module's other paths never need: torch
# (about 2-4 s to import) or hivemind (which imports torch). The CLIs keep `--help` and their light
# commands from paying for it; `peer join` prints "loading torch and hivemind" before its import.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    ("peer.cli", "peer.node"): "`peer join` only: torch and hivemind (the round loop, the averager)",
    ("peer.cli_common", "peer.net.dht"): "`configure_logging` quiets hivemind's logs: hivemind, imported after "
    "a command's first line (at import it delayed every `peer` command's first line by 2 to 6 s)",
    ("peer.cli_tools", "peer.doctor"): "`peer doctor` only: torch (model, inner loop, device probe)",
    ("peer.cli_tools", "peer.status"): "`peer status` only: hivemind, through peer/net/dht_node.py (start_dht)",
    ("peer.cli_tools", "peer.train.data"): "`peer data prepare` only: torch (the token cache's tensors)",
    ("peer.cli", "peer.train.device"): "`peer swarm` only: torch (resolve_device checks --device once)",
    ("peer.swarm_data", "peer.train.data"): "`peer swarm` reads the data before starting peers: torch, which "
    "the launcher otherwise never needs",
    ("peer.swarm_data", "peer.shards.corpus"): "`peer swarm` on a sharded run reads its list and validation "
    "shards before starting peers: torch",
    ("bootstrap.cli", "bootstrap.node"): "`bootstrap run` only: hivemind, through the record validator",
    ("bootstrap.cli", "peer.net.dht_node"): "`bootstrap monitor` only: hivemind, through the record validator",
    ("bootstrap.cli", "bootstrap.monitor"): "`bootstrap monitor` only: hivemind, imported after its first line",
    ("bootstrap.cli", "peer.net.dht"): "`bootstrap run`/`monitor`: hivemind, imported after their first line",
}

FORBIDDEN_IN_PROTOCOL = ("hivemind", "click")
"""protocol/ is the pure layer: it never imports these, not even inside a function."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, type_only: bool):
    """Yield (node, at_module_level) for every import statement; those in `if TYPE_CHECKING:` bodies
    only if `type_only`."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from visit_one(sub, in_function)
                continue
            yield from visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, not in_function
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from visit(node, inner)

    yield from visit(tree, False)


def _resolve(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules) -> list[str]:
    """The project modules an import statement loads (its own names only, not their parents)."""

    def ours(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    targets = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in PACKAGES and (target := ours(alias.name)):
                targets.append(target)
        return targets
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source.split(".")[0] not in PACKAGES:
        return targets
    for alias in node.names:
        if f"{source}.{alias.name}" in modules:
            targets.append(f"{source}.{alias.name}")
        elif target := ours(source):
            targets.append(target)
    return targets


def import_graph(*, type_only: bool = False):
    """Edges {module: {imported module: [line, ...]}} and the function-level ones {(a, b): [line, ...]};
    with `type_only`, the imports under `if TYPE_CHECKING:` too."""
    modules = project_modules()
    edges: dict[str, dict[str, list[int]]] = {name: defaultdict(list) for name in modules}
    function_level: dict[tuple[str, str], list[int]] = defaultdict(list)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, at_module_level in _imports(tree, type_only):
            for target in _resolve(node, name, path.name == "__init__.py", modules):
                if target == name:
                    continue
                edges[name][target].append(node.lineno)
                if not at_module_level:
                    function_level[(name, target)].append(node.lineno)
    return edges, function_level


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component bigger than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # Shortest path back to start through the component (BFS).
        parent = {start: None}
        queue = [start]
        found = None
        while queue and found is None:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    found = v
                    break
                if w in members and w not in parent:
                    parent[w] = v
                    queue.append(w)
        path = []
        v = found
        while v is not None:
            path.append(v)
            v = parent[v]
        cycles.append(path[::-1] + [start])
    return cycles


def _describe(cycles, edges=None) -> str:
    lines = []
    for cycle in cycles:
        if edges is None:
            lines.append("  " + " -> ".join(cycle))
            continue
        hops = [f"{a} -> {b} (line {', '.join(map(str, edges[a][b]))})" for a, b in zip(cycle, cycle[1:])]
        lines.append("  cycle:\n" + "\n".join("    " + hop for hop in hops))
    return "\n".join(lines)


def _folder(module: str) -> str | None:
    """The folder of peer/ a module lives in (peer.sync.x -> peer.sync); None for peer/'s own files."""
    parts = module.split(".")
    if parts[0] != "peer" or len(parts) < 2:
        return None
    folder = f"peer.{parts[1]}"
    return folder if (ROOT / "peer" / parts[1]).is_dir() else None


def test_no_import_cycle_between_modules():
    edges, _ = import_graph(type_only=True)
    cycles = _cycles({a: set(targets) for a, targets in edges.items()})
    assert not cycles, "import cycles:\n" + _describe(cycles, edges)


def test_no_import_cycle_between_peer_folders():
    edges, _ = import_graph(type_only=True)
    folders: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[str]] = defaultdict(list)
    for a, targets in edges.items():
        for b in targets:
            fa, fb = _folder(a), _folder(b)
            if fa and fb and fa != fb:
                folders[fa].add(fb)
                why[(fa, fb)].append(f"{a} -> {b}")
    for folder in list(folders):
        for target in folders[folder]:
            folders.setdefault(target, set())
    cycles = _cycles(folders)
    detail = []
    for cycle in cycles:
        for a, b in zip(cycle, cycle[1:]):
            detail.append(f"  {a} -> {b}: " + "; ".join(why[(a, b)]))
    assert not cycles, "folder cycles:\n" + _describe(cycles) + "\nbecause:\n" + "\n".join(detail)


def test_sync_and_state_folders_are_one_way():
    edges, _ = import_graph()
    directions = {(_folder(a), _folder(b)) for a, targets in edges.items() for b in targets if _folder(a) != _folder(b)}
    assert not {("peer.sync", "peer.state"), ("peer.state", "peer.sync")} <= directions


def test_train_imports_nothing_from_state():
    edges, _ = import_graph()
    bad = [
        f"{a} -> {b} (line {', '.join(map(str, lines))})"
        for a, targets in edges.items()
        if a.startswith("peer.train.")
        for b, lines in targets.items()
        if b == "peer.state" or b.startswith("peer.state.")
    ]
    assert not bad, "peer/train/ imports peer/state/:\n  " + "\n  ".join(bad)


def test_no_function_level_imports_of_our_modules():
    _, function_level = import_graph()
    bad = [
        f"{a} -> {b} (line {', '.join(map(str, lines))})"
        for (a, b), lines in sorted(function_level.items())
        if (a, b) not in FUNCTION_LEVEL_ALLOWED
    ]
    assert not bad, "function-level imports of project modules (move them to module level):\n  " + "\n  ".join(bad)


def test_function_level_allowlist_is_current():
    _, function_level = import_graph()
    stale = [pair for pair in FUNCTION_LEVEL_ALLOWED if pair not in function_level]
    assert not stale, f"allowlisted imports no longer function-level (drop them from the list): {stale}"


REFUSE = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("hivemind", "click"):
                raise ImportError(f"protocol/ must not import {name}")
            return None

    sys.meta_path.insert(0, Refuse())
    failed = []
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception as error:
            failed.append(f"{name}: {type(error).__name__}: {error}")
    print("\\n".join(failed))
    sys.exit(1 if failed else 0)
    """
)


def test_protocol_source_never_imports_hivemind_or_click():
    bad = []
    for name, path in project_modules().items():
        if not (name == "protocol" or name.startswith("protocol.")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{name} (line {node.lineno}): {n}" for n in names if n.split(".")[0] in FORBIDDEN_IN_PROTOCOL]
    assert not bad, "protocol/ imports:\n  " + "\n  ".join(bad)


def test_protocol_imports_without_hivemind_or_click():
    names = sorted(name for name in project_modules() if name == "protocol" or name.startswith("protocol."))
    result = subprocess.run(
        [sys.executable, "-c", REFUSE, *names], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, "protocol modules that need hivemind or click:\n" + result.stdout + result.stderr


MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 30


def test_no_module_over_600_lines_and_no_class_over_30_methods():
    """The size rule (issue #66 item 5): a module of peer/, protocol/ or bootstrap/ that grows past
    600 lines, or a class past 30 methods (properties included), is split before it lands."""
    long, wide = [], []
    for module, path in sorted(project_modules().items()):
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            long.append(f"{module}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for f in node.body)
                if methods > MAX_CLASS_METHODS:
                    wide.append(f"{module}.{node.name}: {methods} methods")
    assert not long and not wide, "split these: " + "; ".join(long + wide)
