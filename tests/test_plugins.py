"""The one resolver of user code in params (qerl.plugins): modules and files, and its one-line errors, as the reward
functions, tools and environments each name them."""

import pytest

from qerl.data.rewards import get_reward_fn
from qerl.plugins import resolve_callable
from qerl.rollout.tool_calls import load_tools

FILE = '''
def shout(text: str) -> str:
    """Shout.

    Args:
        text: What to shout.
    """
    return text.upper()


class Counter:
    def reset(self, **row):
        self.n = 0
'''


def test_a_module_and_a_file_resolve_and_a_file_is_imported_once(tmp_path, monkeypatch):
    assert resolve_callable("qerl.plugins:resolve_callable", "tool") is resolve_callable
    path = tmp_path / "user_code.py"
    path.write_text(FILE)
    shout = resolve_callable(f"{path}:shout", "tool")
    assert shout("hi") == "HI"
    monkeypatch.chdir(tmp_path)  # a relative path, from the working folder: the same module, not a second copy
    assert resolve_callable("user_code.py:Counter", "environment") is resolve_callable(f"{path}:Counter", "tool")
    assert load_tools([f"{path}:shout"]) == {"shout": shout}
    assert get_reward_fn("./user_code.py:shout") is shout


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "name it as 'package.module:function' or 'path/to/file.py:function'"),
    ("tests.nowhere:fn", "cannot import module 'tests.nowhere'"),
    ("missing.py:fn", "cannot import module 'missing.py' (no file "),
    ("tests.test_plugins:nothing", "tests.test_plugins.nothing is missing"),
    ("tests.test_plugins:FILE", "tests.test_plugins.FILE is not callable"),
])
def test_a_spec_that_does_not_resolve_is_one_line_naming_it_and_what_failed(spec, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^environment " + repr(spec).replace(".", r"\.") + ": ") as e:
        resolve_callable(spec, "environment")
    assert match in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_fails_to_import_names_its_error_and_imports_again_once_fixed(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_package_anywhere\n")
    with pytest.raises(ValueError, match=r"^reward .*: cannot import module .*broken\.py' \(ModuleNotFoundError: "
                                         r"No module named 'no_such_package_anywhere'\)$"):
        get_reward_fn(f"{path}:fn")
    path.write_text("def fn(completion, gold):\n    return 1.0\n")
    assert get_reward_fn(f"{path}:fn")("", "") == 1.0
