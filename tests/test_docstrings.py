"""Every module and every public class of the packages says what it is (a docstring, read with ast)."""
import ast

from test_import_layers import module_files


def missing_docstrings(source, module):
    """'module' / 'module.Class' for the module and each public class (at any depth) without a docstring."""
    tree = ast.parse(source)
    missing = [] if ast.get_docstring(tree) else [module]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and not ast.get_docstring(node):
            missing.append(f"{module}.{node.name}")
    return missing


def test_every_module_and_public_class_has_a_docstring():
    missing = []
    for module, path in sorted(module_files().items()):
        missing += missing_docstrings(path.read_text(), module)
    assert missing == []


def test_a_missing_docstring_is_reported():  # negative control
    source = '"""Doc."""\nclass Named:\n    """Doc."""\nclass Bare:\n    pass\nclass _Private:\n    pass\n'
    assert missing_docstrings(source, "m") == ["m.Bare"]
    assert missing_docstrings("x = 1\n", "m") == ["m"]
