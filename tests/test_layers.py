"""The layer order of the package, stated once (:data:`LAYERS`, shown in docs/internals.md) and
enforced on every import, those inside functions too (parsed with ``ast``, nothing is imported):

* a module may import from its own layer or the layers below it, never from one above;
* the packages may not import each other in a cycle (within a layer too);
* nor may the files (modules) of the package, within one package or across them: a cycle of
  imports between files is a cycle however the imports are placed (inside functions, under
  ``TYPE_CHECKING``), except the ones in :data:`FILE_CYCLES`, a list that may only shrink;
* a private name (``_x``) is not imported from another module, except the ones in
  :data:`PRIVATE_IMPORTS`, a list that may only shrink (a stale entry fails too);
* an import inside a function says why it is not at module level (:data:`IMPORT_REASONS`).

Each check has a negative control: planted sources fed to the same functions make it fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_symmetry"

#: bottom to top; a package is a top-level module or sub-package of ``hf_symmetry`` (``hf_symmetry``
#: itself is the root ``__init__``); ``conversion`` has one package per conversion that has grown one
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "modeling",
        ("modeling",),
        "hf_symmetry's own model families: standalone remote-code files, they import nothing of the package",
    ),
    (
        "foundations",
        ("hf_symmetry", "devices", "assets", "checkpoint_io", "text", "gguf_pretokenizer", "flags"),
        "the root (version, registration), devices, offline assets, safetensors I/O, text reading and naming, "
        "command-line flags declared on options",
    ),
    ("symmetry", ("symmetry",), "the groups, head layouts and group actions on canonical layers"),
    (
        "solvers",
        ("solvers",),
        "the compression and FaRR solvers: structured matrices, segment solves, fused maps, their linear algebra",
    ),
    ("architectures", ("architectures",), "per-family specs and the adapter to the canonical form"),
    ("calibration", ("calibration",), "the layer-wise calibration engine and its batches"),
    ("evaluation", ("evaluation",), "loading, comparing, perplexity, verification, lm-eval, plots"),
    ("hub", ("hub",), "model cards, their evaluation entries, the pre-push check and the push"),
    (
        "conversion",
        (
            "conversion",
            "conversion.compress",
            "conversion.farr",
            "conversion.match",
            "conversion.merge",
            "conversion.quantization",
            "conversion.to_tpa",
        ),
        "the conversions, on the shared streaming loop (`conversion.stream`)",
    ),
    ("training", ("training",), "training, distillation and `heal` (recovery fine-tuning of a converted model)"),
    ("commands", ("commands", "cli", "__main__", "testing"), "the command line, and the test helpers"),
]

#: (importing module, imported module, name), under ``hf_symmetry.``: private names still imported
#: across modules. May only shrink: remove an entry when its import goes (a stale entry fails).
PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

#: (importing package, imported package): upward imports left in code another piece of work owns,
#: each with its reason. May only shrink, like :data:`PRIVATE_IMPORTS`.
UPWARD_IMPORTS: dict[tuple[str, str], str] = {}


#: cycles between files left in code another piece of work owns (each a sorted list of modules under
#: ``hf_symmetry.``), with the reason. May only shrink, like :data:`PRIVATE_IMPORTS`.
FILE_CYCLES: dict[tuple[str, ...], str] = {}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """Every import of ``module``'s source, module level or nested: (absolute module imported,
    name imported from it or None, line)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(target, a.name, node.lineno) for a in node.names]
    return found


def package_of(module: str, top: str = "hf_symmetry") -> str | None:
    """The package (a key of the layer table) ``module`` belongs to; None outside ``top``."""
    parts = module.split(".")
    if parts[0] != top:
        return None
    if len(parts) == 1:
        return top
    name = parts[1]
    if name == "conversion" and len(parts) > 2 and f"conversion.{parts[2]}" in _PACKAGES:
        return f"conversion.{parts[2]}"
    return name


_PACKAGES = {p for _, packages, _ in LAYERS for p in packages}
LAYER_OF = {p: i for i, (_, packages, _) in enumerate(LAYERS) for p in packages}


def graph(sources: dict[str, tuple[str, bool]], top: str = "hf_symmetry"):
    """From ``{module: (source, is_package)}``: the list of imports between package modules as
    (module, imported module, name, line)."""
    edges = []
    for module, (source, is_package) in sources.items():
        for target, name, line in imports_of(source, module, is_package):
            if package_of(target, top) is not None:
                if name is not None and f"{target}.{name}" in sources:
                    target, name = f"{target}.{name}", None  # `from . import submodule`
                edges.append((module, target, name, line))
    return edges


def upward_imports(edges, top: str = "hf_symmetry") -> list[str]:
    out = []
    for module, target, name, line in edges:
        a, b = package_of(module, top), package_of(target, top)
        if a not in LAYER_OF or b not in LAYER_OF:
            out.append(f"{module}:{line}: package {a if a not in LAYER_OF else b} is in no layer")
        elif LAYER_OF[b] > LAYER_OF[a] and (a, b) not in UPWARD_IMPORTS:
            out.append(f"{module}:{line} ({LAYERS[LAYER_OF[a]][0]}) imports {target} ({LAYERS[LAYER_OF[b]][0]})")
    return out


def package_cycles(edges, top: str = "hf_symmetry", known=UPWARD_IMPORTS) -> list[list[str]]:
    """Strongly connected sets of more than one package (Tarjan). The upward imports listed in ``known``
    are left out (each is already a listed exception, on its way out)."""
    succ: dict[str, set[str]] = {}
    for module, target, _, _ in edges:
        a, b = package_of(module, top), package_of(target, top)
        if a != b and b != top and (a, b) not in known:  # every module imports the root package anyway
            succ.setdefault(a, set()).add(b)
            succ.setdefault(b, set())
    return _strongly_connected(succ)


def _strongly_connected(succ: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node of the graph ``succ`` (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def file_cycles(edges, modules, top: str = "hf_symmetry") -> list[tuple[str, ...]]:
    """Strongly connected sets of more than one module (file), named under ``top.``. An import of
    a name resolves to the module that holds it: ``from .pkg import name`` to ``pkg``'s ``__init__``
    (or to the submodule ``pkg.name``), ``import pkg.mod`` to ``pkg.mod``."""
    succ: dict[str, set[str]] = {m: set() for m in modules}
    for module, target, _, _ in edges:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != module and target != top:  # every module imports the root
            succ[module].add(target)
    return [tuple(m.removeprefix(top + ".") for m in scc) for scc in _strongly_connected(succ)]


def private_imports(edges, top: str = "hf_symmetry") -> set[tuple[str, str, str]]:
    """(importing module, imported module, private name), both modules named under ``top.``."""

    def short(module):
        return module.removeprefix(top + ".")

    return {
        (short(m), short(t), n) for m, t, n, _ in edges if n and n.startswith("_") and not n.startswith("__") and t != m
    }


def shadowed_submodules(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``package.name`` where a package's ``__init__`` binds ``name`` (by import, ``def``, ``class`` or
    assignment) to something other than its submodule ``name``: ``from .perplexity import perplexity``
    makes ``package.perplexity`` the function, and the module can then only be reached with importlib."""
    out = []
    for module, (source, is_package) in sources.items():
        if not is_package:
            continue
        for node in ast.parse(source).body:
            bound = []
            if isinstance(node, ast.ImportFrom):
                base = module.split(".")[: len(module.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                bound = [(a.asname or a.name, f"{target}.{a.name}") for a in node.names]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = [(node.name, None)]
            elif isinstance(node, ast.Assign):
                bound = [(t.id, None) for t in node.targets if isinstance(t, ast.Name)]
            out += [
                f"{module}.{name}"
                for name, what in bound
                if f"{module}.{name}" in sources and what != f"{module}.{name}"
            ]
    return sorted(out)


#: the reasons an import may stay inside a function (issue 40); anything else is hoisted to module level
IMPORT_REASONS = (
    "# optional dependency",
    "# lazy: keeps `hf-symmetry --help` fast",
    "# lazy: avoids an import cycle",
    "# lazy: runs in the isolated check's interpreter",
)


def unexplained_function_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``module:line`` of every import inside a function body whose first or last line does not say
    why it is there (one of :data:`IMPORT_REASONS`); ``hf_symmetry.modeling`` is left out."""
    out = []
    for module, (source, _) in sources.items():
        if module == "hf_symmetry.modeling" or module.startswith("hf_symmetry.modeling."):
            continue
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    said = lines[node.lineno - 1] + lines[node.end_lineno - 1]
                    if not any(reason in said for reason in IMPORT_REASONS):
                        out.append(f"{module}:{node.lineno}")
    return sorted(set(out))


def package_sources() -> dict[str, tuple[str, bool]]:
    return {
        _module_name(p, PACKAGE): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def layer_table() -> str:
    rows = ["| layer | packages | what it holds |", "|---|---|---|"]
    for i, (name, packages, what) in enumerate(LAYERS):
        rows.append(f"| {i} {name} | {', '.join(f'`{p}`' for p in packages)} | {what} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- the package


def test_every_package_sits_in_a_layer():
    packages = {package_of(m) for m in package_sources()}
    assert packages <= _PACKAGES, f"packages in no layer of LAYERS: {sorted(packages - _PACKAGES)}"
    assert not _PACKAGES - packages, f"LAYERS names packages that do not exist: {sorted(_PACKAGES - packages)}"


def test_every_conversion_package_is_a_package_of_its_own():
    """``conversion/`` is one package per conversion: a sub-package there is a node of the cycle check."""
    subpackages = {f"conversion.{d.name}" for d in (PACKAGE / "conversion").iterdir() if (d / "__init__.py").is_file()}
    assert subpackages <= _PACKAGES, f"add to LAYERS: {sorted(subpackages - _PACKAGES)}"


def test_no_import_runs_up_the_layers():
    edges = graph(package_sources())
    assert not upward_imports(edges), "imports up the layer order:\n" + "\n".join(upward_imports(edges))
    used = {(package_of(m), package_of(t)) for m, t, _, _ in edges}
    assert not set(UPWARD_IMPORTS) - used, f"fixed: remove from UPWARD_IMPORTS: {sorted(set(UPWARD_IMPORTS) - used)}"


def test_no_cycle_between_packages():
    assert package_cycles(graph(package_sources())) == []


def test_no_cycle_between_files():
    sources = package_sources()
    found = file_cycles(graph(sources), sources)
    new = [c for c in found if c not in FILE_CYCLES]
    assert not new, "files that import each other (directly or round a cycle):\n" + "\n".join(map(str, new))
    stale = sorted(set(FILE_CYCLES) - set(found))
    assert not stale, f"fixed: remove from FILE_CYCLES: {stale}"


def test_no_package_hides_a_submodule_behind_a_name():
    assert shadowed_submodules(package_sources()) == []


def test_private_names_stay_in_their_module():
    found = private_imports(graph(package_sources()))
    new = sorted(found - PRIVATE_IMPORTS)
    assert not new, f"private names imported across modules (make them public or keep them home): {new}"
    stale = sorted(PRIVATE_IMPORTS - found)
    assert not stale, f"fixed: remove from PRIVATE_IMPORTS: {stale}"


def test_docs_show_the_layer_table_the_test_checks():
    internals = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    assert layer_table() in internals, "docs/internals.md must show this table:\n" + layer_table()
    for _, packages, _ in LAYERS:
        for p in packages:
            if (PACKAGE / p.replace(".", "/")).is_dir():
                assert re.search(rf"`{re.escape(p.replace('.', '/'))}/`", internals), (
                    f"docs/internals.md has no paragraph on `{p.replace('.', '/')}/`"
                )


def test_imports_inside_functions_say_why():
    found = unexplained_function_imports(package_sources())
    assert not found, (
        "imports inside functions without a reason (hoist them, or end the line with one of "
        f"{IMPORT_REASONS}):\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------- negative controls


def _planted(modules: dict[str, str], packages: tuple[str, ...] = ()) -> dict[str, tuple[str, bool]]:
    return {m: (src, m in packages) for m, src in modules.items()}


def test_a_planted_upward_import_fails():
    sources = _planted(
        {
            "hf_symmetry.devices": "import torch\n",
            "hf_symmetry.hub.cards": "from ..devices import to_model\n",
            "hf_symmetry.solvers.fused": "def f():\n    from ..hub.cards import write_card\n",
        }
    )
    found = upward_imports(graph(sources))
    assert len(found) == 1 and "hf_symmetry.solvers.fused:2" in found[0], found
    # a package's __init__ resolves relative imports against itself
    sources = _planted(
        {"hf_symmetry.evaluation": "from ..conversion import stream\n"}, packages=("hf_symmetry.evaluation",)
    )
    assert [e[1] for e in graph(sources)] == ["hf_symmetry.conversion"]
    assert len(upward_imports(graph(sources))) == 1


def test_a_planted_cycle_fails():
    sources = _planted(
        {
            "hf_symmetry.evaluation.bridge": "from ..hub.cards import perplexity_result\n",
            "hf_symmetry.hub.push": "def f():\n    import hf_symmetry.evaluation.bridge\n",
        }
    )
    assert package_cycles(graph(sources)) == [["evaluation", "hub"]]
    sources = _planted(
        {
            "hf_symmetry.conversion.compress.solve": "from ..farr import reduce\n",
            "hf_symmetry.conversion.farr.reduce": "from ..compress.solve import x\n",
        }
    )
    assert package_cycles(graph(sources)) == [["conversion.compress", "conversion.farr"]]
    assert package_cycles(graph(_planted({"hf_symmetry.hub.push": "from ..evaluation import bridge\n"}))) == []
    # a listed upward import is left out of the cycle it closes, and only that one
    sources = _planted(
        {
            "hf_symmetry.symmetry.fused": "from ..solvers.fused import check_tau\n",
            "hf_symmetry.solvers.fused": "from ..symmetry.actions import NotASymmetry\n",
        }
    )
    assert package_cycles(graph(sources), known={}) == [["solvers", "symmetry"]]
    assert package_cycles(graph(sources), known={("symmetry", "solvers"): "listed"}) == []
    assert package_cycles(graph(sources), known={("symmetry", "hub"): "listed"}) == [["solvers", "symmetry"]]


def test_a_planted_file_cycle_fails():
    # two files of one package, one import inside a function, the other under TYPE_CHECKING
    sources = _planted(
        {
            "hf_symmetry.calibration.engine": "from .run import Run\n",
            "hf_symmetry.calibration.run": "if TYPE_CHECKING:\n    from .engine import Engine\n",
            "hf_symmetry.calibration.data": "def f():\n    from .engine import Engine\n",
        }
    )
    assert file_cycles(graph(sources), sources) == [("calibration.engine", "calibration.run")]
    # round three files, through a package's __init__ that re-exports a submodule's name
    sources = _planted(
        {
            "hf_symmetry.architectures": "from .adapter import Adapter\n",
            "hf_symmetry.architectures.adapter": "def f():\n    from .capabilities import require\n",
            "hf_symmetry.architectures.capabilities": "from . import Adapter\n",
            "hf_symmetry.architectures.spec": "import hf_symmetry.architectures.adapter\n",
        },
        packages=("hf_symmetry.architectures",),
    )
    assert file_cycles(graph(sources), sources) == [
        ("architectures", "architectures.adapter", "architectures.capabilities")
    ]
    # one direction only: no cycle
    sources = _planted(
        {"hf_symmetry.calibration.engine": "from .run import Run\n", "hf_symmetry.calibration.run": "import torch\n"}
    )
    assert file_cycles(graph(sources), sources) == []


def test_a_planted_shadowed_submodule_fails():
    sources = _planted(
        {
            "hf_symmetry.evaluation": "from ..text import read_text\nfrom .perplexity import perplexity\n"
            "from . import compare\nfrom .compare import load_model\n",
            "hf_symmetry.evaluation.perplexity": "def perplexity(): ...\n",
            "hf_symmetry.evaluation.compare": "def load_model(): ...\n",
            "hf_symmetry.hub": "def push(): ...\nverify = None\n",
            "hf_symmetry.hub.push": "",
            "hf_symmetry.hub.verify": "",
        },
        packages=("hf_symmetry.evaluation", "hf_symmetry.hub"),
    )
    assert shadowed_submodules(sources) == [
        "hf_symmetry.evaluation.perplexity",
        "hf_symmetry.hub.push",
        "hf_symmetry.hub.verify",
    ]


def test_a_planted_private_import_fails():
    sources = _planted(
        {"hf_symmetry.conversion.merge": "from .rotate import _centre_layer, public\nfrom .. import __version__\n"}
    )
    assert private_imports(graph(sources)) == {("conversion.merge", "conversion.rotate", "_centre_layer")}


def test_a_planted_unexplained_function_import_fails():
    sources = _planted(
        {
            "hf_symmetry.hub.push": "import json\n\ndef f():\n"
            "    from .cards import write_card\n    return write_card\n",
            "hf_symmetry.evaluation.bridge": "def f():\n    import lm_eval  # optional dependency\n"
            "    from transformers import (\n        Trainer,\n    )  # lazy: keeps `hf-symmetry --help` fast\n",
            "hf_symmetry.conversion.rotate": "class A:\n    def m(self):\n        import torch  # we like it here\n",
            "hf_symmetry.modeling.modeling_tpa": "def f():\n    import torch\n",
        }
    )
    assert unexplained_function_imports(sources) == ["hf_symmetry.conversion.rotate:3", "hf_symmetry.hub.push:4"]
