"""The layering of ckpt/ (docs/architecture.md), checked by reading every module's imports,
those inside functions included: a deferred import is still a dependency."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckpt"

# Higher layers may import lower ones, never the other way round. Packages of one layer do not
# import each other (store and criu are independent; so are dump, restore and schedule).
LAYERS = {
    "cli": 5,
    "commands": 4,
    "dump": 3, "restore": 3, "schedule": 3, "agent": 3,
    "store": 2, "criu": 2,
    "system": 1,
    # the foundation every layer uses
    "errors": 0, "reporting": 0, "settings": 0, "phases": 0, "_pagehash": 0,
}
ENTRY_POINTS = {"ckpt.__main__": "cli"}  # `python -m ckpt` is the CLI


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the module, at any depth."""
    path = MODULES[name]
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                # "from ckpt.store import ids" imports the module ckpt.store.ids; "from ckpt.store
                # import Store" imports ckpt.store (its __init__).
                found.append((submodule if submodule in MODULES else base, node.lineno))
    return found


def area(name: str) -> str:
    """The layer key of a ckpt module: its package under ckpt/, or its own name at the top."""
    if name in ENTRY_POINTS:
        return ENTRY_POINTS[name]
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "ckpt"


def internal_edges() -> dict[str, set[str]]:
    return {name: {target for target, _ in imports_of(name) if target in MODULES and target != name}
            for name in MODULES}


def test_every_module_has_a_layer():
    unknown = sorted({area(name) for name in MODULES} - set(LAYERS) - {"ckpt", "__main__"})
    assert unknown == [], f"add these to LAYERS here and to docs/architecture.md: {unknown}"


def test_no_import_cycles():
    graph = internal_edges()
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:  # iterative depth is bounded by the number of modules (~70)
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_point_inward():
    wrong = []
    for name in MODULES:
        source = area(name)
        for target, line in imports_of(name):
            if target not in MODULES or target in ("ckpt",):
                continue
            dest = area(target)
            if source == dest or source == "ckpt":
                continue
            if LAYERS[dest] > LAYERS[source] or (LAYERS[dest] == LAYERS[source] and LAYERS[dest] > 0):
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} ({source}) imports {target} ({dest})")
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def third_party_importers(top_level: str) -> set[str]:
    return {f"{MODULES[name].relative_to(ROOT)}:{line}" for name in MODULES
            for target, line in imports_of(name) if target.split(".")[0] == top_level}


def test_only_the_cli_imports_typer_and_rich():
    for library in ("typer", "rich", "click"):
        outside = {where for where in third_party_importers(library) if not where.startswith("ckpt/cli/")}
        assert outside == set(), f"{library} imported outside ckpt/cli: {sorted(outside)}"


def test_only_ckpt_criu_imports_pycriu():
    outside = {where for where in third_party_importers("pycriu") if not where.startswith("ckpt/criu/")}
    assert outside == set(), f"pycriu imported outside ckpt/criu: {sorted(outside)}"
    # importlib.import_module("pycriu...") would slip past the AST check above
    dynamic = [str(p.relative_to(ROOT)) for p in MODULES.values()
               if "import_module(\"pycriu" in p.read_text() and "ckpt/criu/" not in p.as_posix()]
    assert dynamic == []


def test_use_cases_leave_storage_and_compression_to_the_store():
    """commands/ composes the store's public API: hashing, compression and S3 are the store's
    business (issue 25: copy.py once imported blake3, zstandard and the pack writer)."""
    for library in ("blake3", "zstandard", "xxhash", "boto3", "botocore"):
        inside = {where for where in third_party_importers(library) if where.startswith("ckpt/commands/")}
        assert inside == set(), f"{library} imported by use cases: {sorted(inside)}"
    writers = sorted(name for name in MODULES if name.startswith("ckpt.commands.")
                     if "PackWriter" in MODULES[name].read_text())
    assert writers == [], f"use cases writing packs themselves: {writers}"


def test_the_checks_see_what_they_look_for(tmp_path):
    """The helpers above find deferred and relative imports (else the tests would pass vacuously)."""
    found = dict(imports_of("ckpt.commands.dump"))
    assert "ckpt.store" in found and "ckpt.criu.images" in found  # the latter is deferred
    assert third_party_importers("typer")
    assert any(internal_edges().values())


# Functions longer than this are hard to read in one go (issue 25: the whole of ckpt/ fits).
LONGEST_FUNCTION = 50
# Exceptions, each with its reason: (module path, function name) -> why.
LONG_FUNCTIONS_ALLOWED: dict[tuple[str, str], str] = {}


def functions_of(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines) of every function and method of a module."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_too_long():
    too_long = [f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
                for path in MODULES.values() for name, line, length in functions_of(path)
                if length > LONGEST_FUNCTION and (str(path.relative_to(ROOT)), name) not in LONG_FUNCTIONS_ALLOWED]
    assert too_long == [], f"functions over {LONGEST_FUNCTION} lines (split them, or name the reason here):\n" \
        + "\n".join(too_long)


# Settings are built once at the edge (the CLI, or the agent API in the program's own process)
# and passed down as arguments (issue 25): the core has no hidden inputs.
SETTINGS_EDGES = ("ckpt/cli/", "ckpt/agent/checkpoint.py", "ckpt/agent/journal.py", "ckpt/agent/protocol.py")


def test_settings_are_passed_down_not_looked_up():
    lookups = [f"{path.relative_to(ROOT)}:{number}" for path in MODULES.values()
               if not str(path.relative_to(ROOT)).startswith(SETTINGS_EDGES)
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if "from_environment(" in line or "settings.current(" in line]
    lookups = [where for where in lookups if not where.startswith("ckpt/settings.py")]
    assert lookups == [], "settings looked up in the core instead of passed in:\n" + "\n".join(lookups)
