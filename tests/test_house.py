"""The package's structure (read from its source by tests/house.py): no import cycles among its
top-level parts (function-level and TYPE_CHECKING imports count), no function over 80 lines, a
trainer of at most 400 lines, and no component that receives the trainer."""

import ast
import os

import house


def test_no_import_cycles_among_the_top_level_parts():
    assert house.cycles(house.part_graph()) == []


def test_each_part_imports_only_the_parts_below_it():
    assert house.forbidden_imports(house.part_graph()) == []


def test_the_import_rule_fires_on_an_upward_import():
    # the rule is not vacuous: a plugin importing the run, or federated importing the module wrapper, is caught
    graph = house.part_graph()
    planted = {**graph, "plugins": graph["plugins"] | {"run"}, "federated": graph["federated"] | {"module"},
               "newpart": {"errors"}}
    assert house.forbidden_imports(planted) == ["newpart (not placed)", "federated -> module", "plugins -> run"]


def test_the_import_rule_is_a_layering():
    # what the rule allows has no cycle either: no two parts may import each other, even indirectly
    assert house.cycles(house.ALLOWED) == []


def test_no_function_longer_than_80_lines():
    assert [f for f in house.function_lengths() if f[0] > 80] == []


def test_the_trainer_is_not_a_hub():
    path = os.path.join(house.ROOT, "trainer.py")
    assert sum(1 for _ in open(path)) <= 400
    # the pieces of a run never import the trainer (they are built from settings, comm, module, data,
    # plugins; only the command line, which builds a trainer, imports it)
    modules = {house.module_name(p) for p in house.source_files()}
    pieces = ("dpfl_lightning.run.", "dpfl_lightning.executor.", "dpfl_lightning.module.", "dpfl_lightning.plugins.",
              "dpfl_lightning.lightning.semantics", "dpfl_lightning.lightning.callbacks", "dpfl_lightning.federated.aggregation")
    importers = [house.module_name(p) for p in house.source_files() if house.module_name(p).startswith(pieces)
                 and "dpfl_lightning.trainer" in house.imports_of(p, modules)]
    assert importers == []


def test_no_file_reads_another_files_underscore_names():
    # `from dpfl_lightning.x import _name` anywhere in the package
    found = []
    for path in house.source_files():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpfl_lightning"):
                found += [f"{os.path.relpath(path, house.ROOT)}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []
