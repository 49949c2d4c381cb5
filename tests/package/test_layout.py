"""The package's shape: no import cycle, and beam search stays above the engine core."""
from __future__ import annotations

import ast
import pathlib
import re

import pagedlm

ROOT = pathlib.Path(pagedlm.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """pagedlm modules this file imports, anywhere (in functions and under TYPE_CHECKING too:
    a cycle hidden there is still two modules that need each other)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: _imports(p, set(files)) - {m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "pagedlm.entrypoints.beam_search" in graph and len(graph) > 30
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # The checker itself finds a planted cycle.
    assert find_cycle({**graph, "pagedlm.core.scheduler": {"pagedlm.engine.llm_engine"}})


def test_beam_search_stays_above_the_engine():
    # Neither the engine core nor the engines themselves know of beams: the offline LLM and the
    # serving layer drive beam search over them (entrypoints/beam_search.py).
    paths = [p for folder in ("core", "worker") for p in (ROOT / folder).rglob("*.py")]
    paths += [ROOT / "engine" / "llm_engine.py", ROOT / "engine" / "async_llm_engine.py"]
    assert len(paths) > 10 and all(p.exists() for p in paths)
    for path in paths:
        assert "beam" not in path.read_text().lower(), path
    # Nothing in the engine package imports from above it.
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("pagedlm.engine."):
            assert not {d for d in deps if d.startswith("pagedlm.entrypoints")}, module
    assert "pagedlm.entrypoints.beam_search" in graph["pagedlm.entrypoints.llm"]


# What builds, loads or calls native code: a model file reaches kernels only through layers.
KERNEL_MODULES = ("pagedlm.kernels", "pagedlm.model_executor.layers.quantization.kernels")


def kernel_imports(source: str) -> set[str]:
    """The kernel modules (and ctypes) that `source` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] == "ctypes"
                  or any(n == k or n.startswith(k + ".") for k in KERNEL_MODULES)}
    return found


def test_no_model_file_imports_a_kernel_module():
    models = list((ROOT / "model_executor" / "models").rglob("*.py"))
    assert len(models) > 10
    for path in models:
        assert not kernel_imports(path.read_text()), (path.name, kernel_imports(path.read_text()))
    # The checker finds each way of importing one.
    assert kernel_imports("import ctypes\nfrom ctypes import c_int") == {"ctypes",
                                                                           "ctypes.c_int"}
    assert kernel_imports("def f():\n    from pagedlm import kernels as k") == {
        "pagedlm.kernels"}
    assert kernel_imports("import pagedlm.model_executor.layers.quantization.kernels as q")
    assert kernel_imports("from pagedlm.kernels.gemv import gemv") == {
        "pagedlm.kernels.gemv", "pagedlm.kernels.gemv.gemv"}
    assert not kernel_imports("from pagedlm.model_executor.layers import fused_decode")


# The layer map. Each module's layer is named by the longest prefix listed; a layer imports its
# own modules, the leaves, and the layers MAY_IMPORT gives it: entrypoints -> engine -> {core
# (scheduler, block manager), executor -> worker -> model_executor -> attention -> kernels}.
LAYER_OF = {
    "pagedlm.entrypoints": "entrypoints",
    "pagedlm.engine": "engine",
    "pagedlm.metrics": "engine",  # the engine's tracer, Prometheus metrics and engine view
    "pagedlm.inputs": "engine",  # prompts -> token ids, before a request reaches the engine
    "pagedlm.transformers_utils": "engine",  # the engine's tokenizer
    "pagedlm.structured_output": "engine",  # grammars compiled and matched on the engine's side
    "pagedlm.core": "core",
    "pagedlm.executor": "executor",
    "pagedlm.worker": "worker",
    "pagedlm.lora.worker_manager": "worker",  # loads a worker's adapters into its model
    "pagedlm.spec_decode": "worker",  # proposers: the model runner asks them for drafts
    # A draft model's config, checked when the engine's config is built (reads files only).
    "pagedlm.spec_decode.draft_config": "model_executor",
    "pagedlm.lora": "model_executor",  # adapter layers wrap the model's linear layers
    "pagedlm.model_executor": "model_executor",
    "pagedlm.distributed": "model_executor",  # the collectives the parallel layers call
    "pagedlm.attention": "attention",
    "pagedlm.kernels": "kernels",
    # Leaves, which every layer may import: settings, data types, the engine <-> worker
    # boundary (model_io), small helpers. They import only leaves.
    "pagedlm": "leaf",  # the root package's public names are imported lazily, on first use
    "pagedlm.config": "leaf",
    "pagedlm.envs": "leaf",
    "pagedlm.utils": "leaf",
    "pagedlm.staging": "leaf",
    "pagedlm.sequence": "leaf",
    "pagedlm.sampling_params": "leaf",
    "pagedlm.pooling_params": "leaf",
    "pagedlm.outputs": "leaf",
    "pagedlm.model_io": "leaf",
    "pagedlm.lora.request": "leaf",
    "pagedlm.structured_output.backend": "leaf",  # the grammar interfaces
    "pagedlm.structured_output.bitmask": "leaf",
    "pagedlm.structured_output.limits": "leaf",
    "pagedlm.structured_output.request": "leaf",  # a request's grammar, held by its group
    "pagedlm.distributed.utils": "leaf",
    "pagedlm.model_executor.models.registry": "leaf",  # names only: classes load on first use
}
MAY_IMPORT = {
    "entrypoints": {"engine"},
    # The engine reaches the workers only through the executor (they may live in other
    # processes; what crosses is model_io), and uses model_executor's host-side helpers
    # (quantization names, model paths, embedding finalisation, token constraints).
    "engine": {"core", "executor", "model_executor"},
    "core": set(),  # core and worker never import each other
    "executor": {"worker"},
    "worker": {"model_executor", "attention", "kernels"},
    "model_executor": {"attention", "kernels"},
    "attention": {"kernels"},
    "kernels": set(),
    "leaf": set(),
}


def layer_of(module: str) -> str:
    prefix = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[prefix]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        layer = layer_of(module)
        allowed = MAY_IMPORT[layer] | {layer, "leaf"}
        found += [f"{module} ({layer}) imports {dep} ({layer_of(dep)})"
                  for dep in sorted(deps) if layer_of(dep) not in allowed]
    return found


def test_the_import_graph_follows_the_layer_map():
    graph = import_graph()
    assert not graph["pagedlm"], "the root package must import its public names lazily"
    assert layer_violations(graph) == []
    # Every package has its place (a new one must be placed here), and every layer is used.
    assert {layer_of(m) for m in graph} == set(MAY_IMPORT)
    # The boundary: the executor, runner and output processor meet only in model_io.
    assert "pagedlm.model_io" in graph["pagedlm.executor.abstract"]
    assert not {d for d in graph["pagedlm.executor.abstract"] if d.startswith("pagedlm.worker")}
    assert not {d for d in graph["pagedlm.worker.model_runner"] if d.startswith("pagedlm.core")}
    # The checker catches planted violations: an upward import, core <-> worker, a skip past
    # the executor, and a leaf importing a layer.
    for module, dep in [("pagedlm.worker.model_runner", "pagedlm.engine.llm_engine"),
                        ("pagedlm.worker.model_runner", "pagedlm.core.scheduler"),
                        ("pagedlm.core.scheduler", "pagedlm.worker.worker"),
                        ("pagedlm.engine.output_processor", "pagedlm.worker.model_runner"),
                        ("pagedlm.model_io", "pagedlm.model_executor.layers.sampler"),
                        ("pagedlm.kernels", "pagedlm.attention")]:
        planted = {**graph, module: graph[module] | {dep}}
        assert layer_violations(planted) == [
            f"{module} ({layer_of(module)}) imports {dep} ({layer_of(dep)})"], (module, dep)


# One kernel loader: pagedlm/kernels/loader.py alone runs the compiler and opens our shared
# objects; the C sources sit in pagedlm/csrc with one prototype header that each includes;
# each exported function has one ctypes signature; nobody reaches the package's private names.
LIBC_USERS = {"pagedlm.worker.malloc_tuning", "pagedlm.executor.multiproc_executor",
              "pagedlm.engine.loop_channel", "pagedlm.huge_pages", "pagedlm.prefault"}


def native_loads(tree: ast.AST) -> list[str]:
    """What this module opens with ctypes (the first argument's source), and compiler names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("CDLL", "PyDLL", "LoadLibrary"):
                found.append(ast.unparse(node.args[0]) if node.args else "")
        elif isinstance(node, ast.Constant) and node.value in ("gcc", "cc", "clang", "-shared"):
            found.append(node.value)
    return found


def private_kernel_names(tree: ast.AST) -> list[str]:
    """Underscored names of pagedlm.kernels modules that this module reaches."""
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith("pagedlm.kernels"):
                    aliases[a.asname or a.name] = full
                    if a.name.startswith("_"):
                        found.append(full)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pagedlm.kernels") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            text = ast.unparse(node)
            if ((isinstance(base, ast.Name) and base.id in aliases
                 or text.startswith("pagedlm.kernels."))
                    and any(p.startswith("_") and not p.startswith("__") for p in chain)):
                found.append(text)
    return sorted(set(found))


def test_one_kernel_loader():
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        loads = native_loads(tree)
        if module == "pagedlm.kernels.loader":
            assert "CDLL" in path.read_text() and "COMPILER" in path.read_text()
        elif module in LIBC_USERS:
            assert loads and all(arg == "'libc.so.6'" for arg in loads), (module, loads)
        else:
            assert not loads, (module, loads)
        if not module.startswith("pagedlm.kernels"):
            assert not private_kernel_names(tree), (module, private_kernel_names(tree))
    # The checkers find what they look for.
    assert native_loads(ast.parse("import ctypes\nctypes.CDLL(str(path))")) == ["str(path)"]
    assert native_loads(ast.parse("subprocess.run(['gcc', '-O3'])")) == ["gcc"]
    assert private_kernel_names(ast.parse(
        "from pagedlm.kernels import loader\nloader._cpu_signature()")) == [
        "loader._cpu_signature"]
    assert private_kernel_names(ast.parse("from pagedlm.kernels.gemv import _call"))
    assert private_kernel_names(ast.parse("import pagedlm.kernels\npagedlm.kernels.gemv._p"))
    # Every C file in one place, each including the one prototype header.
    csrc = ROOT / "csrc"
    native = [p for p in ROOT.rglob("*") if p.suffix in (".c", ".h")]
    assert {p.parent for p in native} == {csrc, csrc / "include"}
    for source in csrc.glob("*.c"):
        assert '#include "include/pagedlm_ops.h"' in source.read_text(), source.name
    # The exported functions, each declared once in the header and typed once in Python.
    header = (csrc / "include" / "pagedlm_ops.h").read_text()
    declared = re.findall(r"^(?:int|void) (\w+)\(", header, re.M)
    typed = []
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "typed_library"
                    and isinstance(node.args[0], ast.Dict)):
                typed += [k.value for k in node.args[0].keys]
    assert len(declared) > 15 and sorted(typed) == sorted(declared)


def environ_reads(source: str) -> list[int]:
    """Lines of `source` that read an environment variable: os.environ.get / [...] / in,
    os.getenv. Copying the whole environment for a child process (dict(os.environ)) and writing
    a variable are not reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get":  # os.environ.get(...)
                target = node.func.value
            elif node.func.attr == "getenv":  # os.getenv(...)
                target = node.func
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target = node.value
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            target = node.comparators[0]
        if target is not None and ast.unparse(target) in ("os.environ", "environ", "os.getenv"):
            found.append(node.lineno)
    return found


def test_environment_variables_are_read_only_in_envs():
    for path in ROOT.rglob("*.py"):
        if path != ROOT / "envs.py":
            assert not environ_reads(path.read_text()), (path, environ_reads(path.read_text()))
    assert environ_reads((ROOT / "envs.py").read_text())
    # The checker finds each way of reading one, and lets a child's environment be written.
    for read in ('os.environ.get("X")', 'os.environ["X"]', 'os.getenv("X")',
                 '"X" in os.environ', 'from os import environ\nenviron.get("X")'):
        assert environ_reads(read), read
    assert not environ_reads('os.environ["X"] = "1"\nenv = dict(os.environ, X="1")')
