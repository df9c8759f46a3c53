"""The packages import one way: a layer imports only layers below it, and nothing imports in a circle.

The graph is read from the source with `ast`, so it counts every import — at module level and
inside functions (a lazy import is still a dependency, it only hides it). Dynamic imports by
name (`importlib.import_module(f"rollout.embedded.proposers.{name}")`, the registries' plug-ins) are not
seen; they stay inside one package.
"""
import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mtp", "vime", "checkpoint_convert", "rollout", "trainer", "orchestration")
SCRIPTS = ("train_rl",)

# Bottom to top, as README's layout reads. A layer may import the layers listed before it.
# Layers with more than one column sit side by side: a column imports neither of the others.
# A module belongs to the longest prefix that names it.
LAYERS = (
    ("pure MTP math", {"mtp": ("mtp",)}),
    ("shared basics: Sample, weight-sync wire format, logging, atomic saves", {"vime": ("vime",)}),
    ("model families and draft kinds (pure): registries, HF checkpoint and draft formats, megatron-core and vLLM "
     "name maps", {"models": ("vime.models",)}),
    ("the run's config (pure): the dataclass tree + CLI, the speculative config (it names the draft kinds),"
     " and the memory plan's CLI, which takes the tree's flags (its counting is the models layer's)",
     {"config": ("vime.config", "vime.cli_config", "vime.spec_config", "vime.memory_plan")}),
    ("the two sides' own basics: rollout's stats, task, tokenizer, data; the trainer",
     {"rollout": ("rollout",), "trainer": ("trainer",)}),
    ("the two rollout engines, side by side", {"embedded": ("rollout.embedded",), "vllm": ("rollout.vllm",)}),
    ("the rollout front: the backend seam, Ray rollout workers, the generate CLI, the tiny model recipe",
     {"rollout": ("rollout.backend", "rollout.ray_workers", "rollout.generate", "rollout.tiny_model")}),
    ("checkpoint converters (they build a trainer)", {"converters": ("checkpoint_convert",)}),
    ("orchestration: driver-side actor handles, weight-sync protocol, the RL loop",
     {"orchestration": ("orchestration", "train_rl")}),
)
# Pure modules run anywhere (no Ray cluster, no Megatron, no vLLM), nor does anything they import;
# the shared layer vime/ (model families included) too, so both sides and tools can use it.
PURE = ("mtp", "vime")
HEAVY = ("ray", "megatron", "vllm")
# vLLM's weight-transfer API: its modules, and the methods of vllm.LLM that drive its transfer engine.
# Only the vLLM backend speaks it (both ends: the engine's receiver and the trainer's sending end it
# hands over); the trainer and the rollout worker move weights through the transport registries.
WEIGHT_TRANSFER_MODULES = ("vllm.distributed.weight_transfer", "vllm.config.weight_transfer", "vllm.entrypoints.rl")
WEIGHT_TRANSFER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                           "update_weights", "finish_weight_update")
WEIGHT_TRANSFER_HOME = "rollout.vllm"


def module_files():
    """{module name: path} for every .py of the packages and the top-level scripts."""
    found = {name: REPO / f"{name}.py" for name in SCRIPTS}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(source, module, is_package):
    """Every dotted name `source` imports, anywhere in the file (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def owning_module(name, modules):
    """The longest known module that `name` is or lies in (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_graph():
    """({module: set of our modules it imports}, {module: set of top-level outside packages it imports})."""
    files = module_files()
    inside, outside = {}, {}
    for module, path in files.items():
        names = imported_names(path.read_text(), module, path.name == "__init__.py")
        inside[module] = {owning_module(n, files) for n in names} - {None, module}
        outside[module] = {n.split(".")[0] for n in names if owning_module(n, files) is None}
    return inside, outside


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def place(module, layers=LAYERS):
    """(rank, column) of a module: the entry whose prefix names it longest; None if none does."""
    best = None
    for rank, (_, columns) in enumerate(layers):
        for column, prefixes in columns.items():
            for prefix in prefixes:
                if module == prefix or module.startswith(prefix + "."):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), rank, column)
    return best and best[1:]


def layer_violations(graph, layers=LAYERS):
    """'a -> b (why)' for each import that goes up a layer or sideways between columns."""
    bad = []
    for module, targets in sorted(graph.items()):
        rank, column = place(module, layers)
        for target in sorted(targets):
            to_rank, to_column = place(target, layers)
            if to_rank > rank:
                bad.append(f"{module} -> {target} (up: {layers[rank][0]!r} imports {layers[to_rank][0]!r})")
            elif to_rank == rank and to_column != column:
                bad.append(f"{module} -> {target} (sideways: {column} imports {to_column})")
    return bad


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer(graph):
    inside, _ = graph
    assert [m for m in sorted(inside) if place(m) is None] == []


def test_no_module_imports_in_a_circle(graph):
    inside, _ = graph
    assert cycles(inside) == []


def test_every_import_goes_down_a_layer_or_stays_in_its_column(graph):
    inside, _ = graph
    assert layer_violations(inside) == []


def test_the_rollout_side_and_the_trainer_never_import_each_other(graph):
    inside, _ = graph
    side = lambda module: module.split(".")[0]
    crossings = [f"{m} -> {t}" for m, targets in sorted(inside.items()) for t in sorted(targets)
                 if {side(m), side(t)} == {"rollout", "trainer"}]
    assert crossings == []


def test_pure_modules_and_what_they_import_need_no_ray_megatron_or_vllm(graph):
    inside, outside = graph
    for module in sorted(inside):
        if place(module, (("pure", {"pure": PURE}),)) is None:
            continue
        for dependency in {module} | reachable(inside, module):
            heavy = outside[dependency] & set(HEAVY)
            assert not heavy, f"pure {module} imports {dependency}, which imports {sorted(heavy)}"


def weight_transfer_uses(source, module, is_package):
    """The vLLM weight-transfer modules `source` imports and the weight-transfer methods it calls."""
    modules = {n for n in imported_names(source, module, is_package)
               if any(n == m or n.startswith(m + ".") for m in WEIGHT_TRANSFER_MODULES)}
    methods = {node.attr for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Attribute) and node.attr in WEIGHT_TRANSFER_METHODS}
    return modules | methods


def weight_transfer_users():
    """{module: what of vLLM's weight-transfer API it uses} over the packages and scripts."""
    found = {}
    for module, path in module_files().items():
        used = weight_transfer_uses(path.read_text(), module, path.name == "__init__.py")
        if used:
            found[module] = used
    return found


def test_only_the_vllm_backend_uses_vllms_weight_transfer_api():
    users = weight_transfer_users()
    assert users, "the vLLM backend's NCCL transfer is no longer found: the check has nothing to check"
    outside = {m: sorted(used) for m, used in users.items()
               if not (m == WEIGHT_TRANSFER_HOME or m.startswith(WEIGHT_TRANSFER_HOME + "."))}
    assert outside == {}


def test_the_rollout_worker_and_the_trainer_actor_name_no_engines_transport(graph):
    """They move weights through the backend protocol and the sender registry, whatever the engine."""
    inside, outside = graph
    files = module_files()
    for module in ("rollout.ray_workers", "trainer.ray_actor"):
        assert "vllm" not in outside[module], module
        assert [t for t in inside[module] if t.startswith(WEIGHT_TRANSFER_HOME)] == [], module
        tree = ast.parse(files[module].read_text())
        defined = {node.name for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
        assert [n for n in sorted(defined) if "vllm" in n.lower() or "nccl" in n.lower()] == [], module


def test_the_speculative_config_is_parsed_and_checked_in_one_module():
    """vime/spec_config.py parses it and holds its checks; an engine keeps only its own checks, beside it."""
    assert [m for m in sorted(module_files()) if m.rsplit(".", 1)[-1] == "spec_config"] == ["vime.spec_config"]


# negative controls: the checks above can fail


def test_a_weight_transfer_import_or_call_outside_the_vllm_backend_is_seen():
    source = ("from vllm.distributed.weight_transfer.nccl_common import trainer_init\n"
              "def f(llm):\n    llm.start_draft_weight_update()\n")
    assert weight_transfer_uses(source, "trainer.x", False) == {
        "vllm.distributed.weight_transfer.nccl_common", "vllm.distributed.weight_transfer.nccl_common.trainer_init",
        "start_draft_weight_update"}
    assert weight_transfer_uses("import vllm\nfrom vllm import LLM\n", "trainer.x", False) == set()


def test_a_function_level_import_is_an_import():
    source = "import os\n\ndef f():\n    from rollout.embedded.engine import Engine\n    from . import spec_stats\n"
    assert imported_names(source, "trainer.x", False) >= {"os", "rollout.embedded.engine", "trainer.spec_stats"}


def test_a_cycle_is_found_and_a_chain_is_not():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_an_upward_or_sideways_import_is_a_violation():
    layers = (("low", {"low": ("base",)}), ("sides", {"left": ("left",), "right": ("right",)}),
              ("top", {"top": ("top",)}))
    assert layer_violations({"base.x": set(), "left.a": {"base.x"}, "top": {"left.a", "right"}}, layers) == []
    bad = layer_violations({"base.x": {"top"}, "left.a": {"right.b"}, "right.b": set(), "top": set()}, layers)
    assert [b.split(" (")[0] for b in bad] == ["base.x -> top", "left.a -> right.b"]


def test_the_readme_layout_table_names_every_package_and_only_paths_that_exist():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| path | what it owns |"):].split("\n\n")[0]
    paths = [line.split("`")[1] for line in table.splitlines()[2:]]
    assert [p for p in paths if not (REPO / p).exists()] == []
    assert [p for p in PACKAGES if f"{p}/" not in paths] == []
    # the table lists the layered packages bottom to top, like LAYERS
    order = [paths.index(f"{p}/") for p in ("mtp", "vime", "rollout", "trainer", "checkpoint_convert", "orchestration")]
    assert order == sorted(order)
