"The examples in the package's docstrings run, and say what the code gives (docs/api.md copies them)"
import doctest, importlib, warnings

import pytest

import accum_callback

MODULES = list(accum_callback._LAYERS)   # (every module of every tier)

def test_the_package_has_examples_and_each_module_is_read():
    found = {m: sum(len(t.examples) for t in doctest.DocTestFinder().find(importlib.import_module(f'accum_callback.{m}')))
             for m in MODULES}
    assert sum(found.values()) >= 10, found   # (a finder that reads nothing would make the test below pass vacuously)
    assert found['window.state'] >= 3 and found['batchnorm.norm_layers'] >= 5, found

@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f'accum_callback.{name}')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True, verbose=False)
    assert res.failed == 0, f'{res.failed} of {res.attempted} examples in accum_callback.{name} fail (printed above)'
