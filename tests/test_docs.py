"""The docs a newcomer reads: the README stays short (<= 15 kB) and every relative link in it and in docs/ resolves; every
public name has a docstring and docs/api.md lists them all as the code says (regenerate: `python tests/test_docs.py`)."""
import inspect, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT/'README.md', *sorted((ROOT/'docs').glob('*.md'))]
PATCHES = ('accumulate', 'check_accumulation', 'noise_scale', 'check_batchnorm', 'to_fsdp', 'from_fsdp', 'fsdp_ctx',
           'fsdp_checkpoints')   # on fastai's Learner

def test_readme_is_short():
    assert len((ROOT/'README.md').read_bytes()) <= 15_000

@pytest.mark.parametrize('doc', DOCS, ids=[p.name for p in DOCS])
def test_relative_links_resolve(doc):
    text = re.sub(r'```.*?```', '', doc.read_text(), flags=re.S)   # links, not code
    links = re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', text)
    bad = [l for l in links if '://' not in l and not l.startswith('mailto:') and not (doc.parent/l).exists()]
    assert not bad, f'{doc.name}: links that resolve to nothing: {bad}'

def _public():
    import accum_callback
    from fastai.learner import Learner
    import importlib
    out = [(n, getattr(accum_callback, n)) for n in accum_callback.__all__]
    out += [(f'Learner.{n}', getattr(Learner, n)) for n in PATCHES]
    # the names users import from a module
    return out + [(f'{m}.{n}', getattr(importlib.import_module(f'accum_callback.{m}'), n))
                  for n,m in sorted(MODULE_NAMES.items(), key=lambda t: (t[1], t[0]))]

MODULE_NAMES = dict(
    Window='window.state', PARTIAL_MODES='window.accumulate', is_out_of_memory='micro', stateful_modules='micro',
    CHECK_CAUSES='check.accumulation', loss_items='core.losses', loss_reduction='core.losses', default_blocks='fsdp',
    fsdp_full_state_dict='fsdp', as_window_schedule='window.schedule', MODES='batchnorm.callback',
    accumulated_momentum='batchnorm.callback', pooled_mean_var='batchnorm.callback', PooledStats='batchnorm.pool',
    BN_MODES='batchnorm.modes', BatchRenorm='batchnorm.norm_layers', BatchRenorm1d='batchnorm.norm_layers',
    BatchRenorm2d='batchnorm.norm_layers', BatchRenorm3d='batchnorm.norm_layers', NoiseScaleSchedule='noise.scale',
    NoiseScaleReport='noise.measure', noise_estimates='noise.scale', precise_bn_stats='batchnorm.precise',
    PopulationStats='batchnorm.precise', BatchNormReport='check.batchnorm')

def _doc_of(obj)->str:
    if isinstance(obj, (tuple, dict, frozenset)): return f'`{obj!r}`' if len(repr(obj)) < 200 else f'{type(obj).__name__} of {len(obj)}'
    return inspect.cleandoc(obj.__doc__ or '')

def api_markdown()->str:
    "docs/api.md as the code says it: every public name, its signature, its docstring and its arguments' comments"
    from fastcore.docments import docments
    lines = ['# API', '', 'Every public name of `accum_callback`: what users call (`from accum_callback import ...`), what it '
             'adds to fastai\'s `Learner`, and the names imported from a module (`from accum_callback.batchnorm.callback import '
             'PooledStats`), with the signatures and docstrings of the code (generated: `python tests/test_docs.py`; '
             '`tests/test_docs.py` fails when this page and the code disagree). In a notebook, fastai\'s `show_doc` '
             'renders each the same way.', '']
    for name,obj in _public():
        lines.append(f'## `{name}`')
        if callable(obj) and not isinstance(obj, (tuple, dict)):
            try: sig = str(inspect.signature(obj))
            except (TypeError, ValueError): sig = '(...)'
            short = name.split('.')[-1]
            lines += ['', '```python', f'{short}{sig}', '```']
        doc = _doc_of(obj)
        lines += ['', doc if doc else '(no docstring)']
        if callable(obj) and not isinstance(obj, (tuple, dict)):
            try: d = docments(obj, full=True)
            except Exception: d = {}
            rows = [(k, v.get('docment')) for k,v in d.items() if k != 'return' and isinstance(v, dict) and v.get('docment')]
            if rows: lines += ['', '| argument | |', '|---|---|'] + [f'| `{k}` | {v} |' for k,v in rows]
        lines.append('')
    return '\n'.join(lines)

def test_every_public_name_has_a_docstring():
    missing = [n for n,o in _public() if not _doc_of(o)]
    assert not missing, f'no docstring: {missing}'

def test_api_page_is_the_code():
    assert (ROOT/'docs'/'api.md').read_text() == api_markdown(), 'docs/api.md is stale: run `python tests/test_docs.py`'

if __name__ == '__main__':
    (ROOT/'docs'/'api.md').write_text(api_markdown())
    print('wrote docs/api.md')
