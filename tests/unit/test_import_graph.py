"""relax's layering, read from its source: every `import` and `from ... import` of every module (function-level
ones included), parsed with ast, as edges between relax's modules, and between its packages (LAYERS)."""

import ast
from pathlib import Path

import relax

PACKAGE_ROOT = Path(relax.__file__).parent

# relax's packages and top-level modules, lowest first: each imports only those before it (docs/architecture.md).
LAYERS = [
    "relax.pins",  # version pins, run on their own by setup.py and the scripts
    "relax.files",
    "relax.ports",
    "relax.console",
    "relax.metric_names",
    "relax.kernels",  # GDN kernels: take device facts as values
    "relax.hf_checkpoint",  # what an HF directory holds and fixes in Megatron
    "relax.platform",  # every device difference
    "relax.ray",  # placement, worker watching, runtime environment
    "relax.sync",  # weight transport to the engines
    "relax.train",  # the Megatron actor, its checkpoints and the --save directory's steps
    "relax.rollout",  # the SGLang engines, prompt data, rewards, rollout data (checked in the actor's batch shape)
    "relax.args",  # flags -> settings: declares and parses
    "relax.run",  # the loop, what it reads first, its state and record
    "relax.tools",  # the subcommands besides train: convert, doctor, patches, submit; tiny models
    "relax.cli",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}


def imported_modules(name: str) -> set[str]:
    """The relax modules that module `name` imports anywhere in its source. `from package import x` imports
    the module package.x when there is one, else the package itself."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import relax.x.y` names the module; drop a trailing attribute
                target = target.rpartition(".")[0]
            if target.startswith("relax") and target != name:
                found.add(target)
    return found


GRAPH = {name: imported_modules(name) for name in MODULES}


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_between(importers: str, imported: str) -> list[str]:
    return sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if in_package(name, importers)
        for target in targets
        if in_package(target, imported)
    )


def test_the_graph_is_read_from_the_source():
    # A module-level and a function-level import, both found.
    assert "relax.hf_checkpoint" in GRAPH["relax.train.actor"]
    assert "relax.train.weight_export" in GRAPH["relax.train.worker"]


def test_args_rollout_and_run_state_read_the_checkpoint_without_the_model_families():
    for package in ("relax.args", "relax.rollout", "relax.run.state", "relax.train.saved_steps", "relax.hf_checkpoint"):
        assert imports_between(package, "relax.train.model") == [], package


def test_sync_is_transport_only():
    assert imports_between("relax.sync", "relax.train") == []


def test_platform_and_kernels_do_not_import_each_other_both_ways():
    # The CPU platform serves megatron's and SGLang's GDN calls with the kernels' torch references; the kernels take
    # device facts as values (relax.kernels.launch), never from the platform.
    assert imports_between("relax.kernels", "relax.platform") == []


def strongly_connected_components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively; components of more than one module."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def test_no_import_cycle_between_modules():
    assert strongly_connected_components(GRAPH) == []


def layer_of(name: str) -> str:
    """The entry of LAYERS that module `name` belongs to."""
    return next(layer for layer in LAYERS if in_package(name, layer))


def test_every_module_has_a_layer():
    unplaced = [name for name in MODULES if name != "relax" and not any(in_package(name, layer) for layer in LAYERS)]
    assert unplaced == [], "add them to LAYERS (and docs/architecture.md)"


def test_no_import_runs_up_the_layers():
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name != "relax"
        for target in targets
        if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(name))
    )
    assert upward == []


def test_no_import_cycle_between_packages():
    packages = {layer: set() for layer in LAYERS}
    for name, targets in GRAPH.items():
        if name != "relax":
            packages[layer_of(name)] |= {layer_of(target) for target in targets} - {layer_of(name)}
    assert strongly_connected_components(packages) == []
