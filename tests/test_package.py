"""The package as a whole: its modules form layers (each imports only those below it), the patches on fastai's Learner
exist whichever name is imported first, and a fit that shards nothing does not load torch's FSDP package."""
import ast, importlib.util, json, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT/'accum_callback'

def _imports(path:Path)->set:
    "The package's own modules a file imports, at its top or inside functions (`from .x import`, `from . import x`)"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module: out.add(node.module.split('.')[0])
            else: out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('accum_callback.'):
            out.add(node.module.split('.')[1])
    return out

def test_modules_form_layers_no_import_circle():
    import accum_callback
    layers = accum_callback._LAYERS
    mods = {p.stem for p in PKG.glob('*.py') if p.stem not in ('__init__', '__main__')}
    assert mods == set(layers), f'modules missing from accum_callback._LAYERS or gone: {mods ^ set(layers)}'
    for i,m in enumerate(layers):
        up = _imports(PKG/f'{m}.py') - set(layers[:i])
        assert not up, f'{m}.py imports {sorted(up)}, which are not below it in {layers}'

@pytest.mark.parametrize('first', ['GradientAccumulation', 'bn_to_groupnorm'])
def test_the_learner_has_every_patch_whichever_name_comes_first(first):
    code = (f"from accum_callback import {first}\nfrom fastai.learner import Learner\n"
            "print(all(hasattr(Learner, n) for n in ('accumulate', 'check_accumulation', 'to_fsdp', 'from_fsdp', 'fsdp_ctx')))")
    res = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.stdout.strip() == 'True', res.stderr[-2000:]

def test_a_fit_that_shards_nothing_does_not_load_fsdp():
    "`bench/fit_memory.py`'s fit, in a fresh process: torch's FSDP package and DTensor stay unloaded (44 MiB of peak memory)"
    spec = importlib.util.spec_from_file_location('fit_memory', ROOT/'bench'/'fit_memory.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    now = mod.run('now')
    assert not now['fsdp'] and not now['dtensor']
