"""The fastai application matrix: every fastai application (a row, built with fastai's own function: `tests/apps.py`)
against every feature of the library (a column). Each cell runs a tiny Learner and checks what the feature promises:

- `exact`: every optimizer step's gradient equals the gradient of one batch of exactly that window's samples (formed
  as fastai collates them, from the weights and model state the window started from), within float32's
  rounding measured on that big batch (float32 against float64, `helpers.floor_tol`), and
  `check_accumulation()` run before training says exact too;
- `differs`: a suspect the cell switched on (BatchNorm in training, dropout, a model whose state carries across loader
  batches, a regulariser over padded positions) makes the steps differ from the big batch (beyond it), and the check
  says NOT exact and names exactly that cause;
- `runs` (BatchNorm modes, `lr_find`, `fine_tune`): the fit runs and leaves what the feature says (one pooled update a
  step, momentum put back, layers converted, weights restored);
- `inference`/`export`: `validate`, `get_preds`, `predict`, `tta` with our callbacks equal fastai's without them, and
  `load_learner` of the export predicts the same;
- `fastai`: fastai itself does not offer this on that application (with or without our callbacks), recorded as such.

The expectations (`EXPECTED`) are the table in docs/fastai.md (`python tests/test_matrix.py` prints it; a test fails when
the page differs). The distributed cells (DDP on 2 gloo processes) are at the end."""
import contextlib, math, warnings
from pathlib import Path

import pytest, torch
from fastai.learner import load_learner

from accum_callback import GradientAccumulation, BatchNormAccumulation, Groups, MicroBatching
from accum_callback.testing import launch_gloo
from apps import ROWS, BS, N_TRAIN, Row, Oracle, OOMAbove, quiet_fit
from helpers import accumulation, flat, floor_tol, forward_floor, rel_err

# The steps are compared with the big batch in float64; the tolerance is float32's own error on that big batch,
# measured in the same step (`Oracle.tol`: `helpers.floor_tol`): it follows the machine's kernels (AVX-512, AVX2, a GPU's)

# -- the columns ---------------------------------------------------------------------------------------------------
# loader batch and GradientAccumulation arguments of each column that trains with the oracle
WINDOWS = dict(
    n_step          = (BS,  dict(n_step=2)),
    target_bs       = (BS,  dict(target_bs=2*BS)),
    micro_bs        = (2*BS, dict(micro_bs=3)),                # a loader batch of 8 in pieces of 3, 3, 2: one step
    micro_bs_window = (2*BS, dict(micro_bs=3, n_step=2)),      # two loader batches in pieces: one step
    auto_train_forward = (2*BS, dict(micro_bs='auto')),        # out of memory above 3 items in the first layer: 8 -> 4 -> 2
    auto_train_loss    = (2*BS, dict(micro_bs='auto')),        # ... in the loss
    bn_freeze       = (BS,  dict(n_step=2)),
    bn_groupnorm    = (BS,  dict(n_step=2)),
    check_batchnorm = (BS,  dict(n_step=2)),                   # BatchNorm trains on micro-batch statistics (no BN callback)
    check_dropout   = (BS,  dict(n_step=2)),                   # dropout on
)
SPANS = {'n_step', 'target_bs', 'micro_bs_window', 'bn_freeze', 'bn_groupnorm', 'check_batchnorm', 'check_dropout'}   # windows of several loader batches
INFERENCE_OOM = ('auto_valid_forward', 'auto_valid_loss')
BN_RUNS = ('bn_pool', 'bn_momentum', 'bn_renorm', 'bn_precise')
OTHER = ('lr_find', 'fine_tune', 'inference', 'export', 'noise_scale')
COLUMNS = list(WINDOWS) + list(INFERENCE_OOM) + list(BN_RUNS) + list(OTHER) + ['ddp']

def applies(row:Row, col:str)->bool:
    "Cells that exist: BatchNorm columns on rows with BatchNorm, the dropout column on rows with a dropout"
    if col.startswith('bn_') or col == 'check_batchnorm': return row.bn
    if col == 'check_dropout': return row.dropout
    if col == 'ddp': return row.ddp
    return True

def expected(name:str, col:str)->tuple:
    "(outcome, causes) of a cell, from what each row is (see the module docstring)"
    row = ROWS[name]
    if col in WINDOWS:
        causes = set()
        if col == 'check_batchnorm': causes.add('batchnorm')
        if col == 'check_dropout': causes.add('dropout')
        if row.stateful and col in SPANS: causes.add('not_per_sample')   # state carries from one loader batch to the next
        return ('differs', frozenset(causes)) if causes else ('exact', frozenset())
    if col in INFERENCE_OOM or col == 'export': return ('equal', frozenset())
    if col == 'inference': return ('equal' + ('' if row.tta else ' (no tta in fastai)'), frozenset())
    if col == 'ddp': return ('exact', frozenset())
    if col == 'noise_scale': return ('measured', frozenset())
    return ('runs', frozenset())

CELLS = [(n, c) for n in ROWS for c in COLUMNS if applies(ROWS[n], c)]

def build(row:Row, col:str, cbs=(), bs=BS, **kw):
    "The row's Learner for a column: BatchNorm frozen and dropout off unless the column is about them"
    bn = {'bn_freeze': 'freeze', 'bn_groupnorm': 'groupnorm', 'bn_pool': 'pool', 'bn_momentum': 'momentum',
          'bn_renorm': 'renorm', 'bn_precise': 'pool', 'check_batchnorm': None}.get(col, 'freeze')
    kw_bn = dict(precise=12) if col == 'bn_precise' else {}
    mode = Groups(4) if bn == 'groupnorm' else bn   # (tiny layers: 2 channels a group)
    extra = [BatchNormAccumulation(mode, **kw_bn)] if row.bn and bn else []
    return row.make(list(cbs) + extra, dropout=col == 'check_dropout', bs=bs, **(row.spans_kw if col in SPANS else {}), **kw)

# -- the cells -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name,col', [c for c in CELLS if c[1] in WINDOWS], ids=[f'{n}-{c}' for n,c in CELLS if c in WINDOWS])
def test_window_cell(name, col, one_thread):
    "Every step against one batch of its samples, and the check's verdict and cause against that measurement"
    row,(bs,ga) = ROWS[name],WINDOWS[col]
    oom = OOMAbove(col.split('_')[-1], 'train') if col.startswith('auto_') else None
    oracle = Oracle(row, oom)
    learn = build(row, col, [*accumulation(**ga), oracle, oracle.start], bs=bs)
    with warnings.catch_warnings():
        # a group of one channel in the tiny models' (N, C) layers: the warning the user gets, not news here
        warnings.filterwarnings('ignore', message='bn_to_groupnorm: .* got one channel per group')
        report = learn.check_accumulation()   # before training: the first window's micro-batches at the weights it starts from
        with oom.install(learn) if oom is not None else contextlib.nullcontext():
            if oom is not None: warnings.filterwarnings('ignore', message='GradientAccumulation: out of memory')   # the halvings
            quiet_fit(learn, 1)
    ga,(outcome,causes) = learn.gradient_accumulation,expected(name, col)
    assert ga.steps == len(oracle.errs) >= 2, 'every step measured'
    if oom is not None: assert oom.hits >= 1 and learn.micro_batching.size == 2   # 8 -> 4 -> 2 items
    # the check looked at the first window: its verdict is the measurement of that window's step
    if outcome == 'exact':
        assert max(oracle.errs) <= oracle.tol, f'steps off the big batch: {oracle.errs} (tolerance {oracle.tol:.2e})'
        assert report.exact, f'the check says NOT exact where every step is:\n{report}'
    else:
        assert oracle.errs[0] > oracle.tol, f'{set(causes)} switched on, yet the first step equals the big batch: {oracle.errs}'
        assert not report.exact and set(report.causes) == causes, f'expected cause {set(causes)}, the check says:\n{report}'
    assert ga.window_sizes[0] == (2 if col in SPANS else 1)*bs   # the first window: two loader batches, or one cut in pieces

@pytest.mark.parametrize('name,col', [c for c in CELLS if c[1] in INFERENCE_OOM], ids=[f'{n}-{c}' for n,c in CELLS if c in INFERENCE_OOM])
def test_inference_out_of_memory_cell(name, col, one_thread):
    """micro_bs='auto': a validation/inference batch that runs out of memory in the model or in the loss is cut, and
    fit's validation, `validate` and `get_preds` give what the uncut batch gives"""
    row = ROWS[name]
    learn = build(row, col, [GradientAccumulation(n_step=1), MicroBatching('auto')], bs=2*BS)
    ref_learn = build(row, col, [GradientAccumulation(n_step=1), MicroBatching('auto')], bs=2*BS)
    with OOMAbove(col.split('_')[-1], 'valid').install(learn) as oom, warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='GradientAccumulation: out of memory in inference')
        quiet_fit(learn, 1); quiet_fit(ref_learn, 1)
        assert oom.hits >= 1 and learn.micro_batching.inference_bs is not None
        assert rel_err(flat(learn.model.parameters()).detach(), flat(ref_learn.model.parameters()).detach()) == 0
        oom.enabled = False   # (the loss can be shared between Learners): the simulated device has room for the floor
        tol = floor_tol([forward_floor(ref_learn, row.loss, row.state64)])   # float32's rounding on one uncut batch
        oom.enabled = True
        got,want = learn.recorder.values[-1],ref_learn.recorder.values[-1]   # fit's own validation
        assert all(abs(a-b) <= tol*abs(b) for a,b in zip(got, want)), (got, want, tol)
        v,vr = learn.validate(),ref_learn.validate()
        assert all(abs(a-b) <= tol*abs(b) for a,b in zip(v, vr)), (v, vr, tol)
        p,t = learn.get_preds(**row.preds_kw); pr,tr = ref_learn.get_preds(**row.preds_kw)
        assert (p-pr).abs().max() <= tol*pr.abs().max() and torch.equal(t, tr), ((p-pr).abs().max(), tol)

def _bn_layers(learn):
    from torch.nn.modules.batchnorm import _BatchNorm
    return [m for m in learn.model.modules() if isinstance(m, _BatchNorm)]

@pytest.mark.parametrize('name,col', [c for c in CELLS if c[1] in BN_RUNS], ids=[f'{n}-{c}' for n,c in CELLS if c in BN_RUNS])
def test_batchnorm_mode_cell(name, col, one_thread):
    "Each BatchNorm mode trains the application and leaves what it promises"
    row = ROWS[name]
    learn = build(row, col, [GradientAccumulation(n_step=2)])
    momenta = [m.momentum for m in _bn_layers(learn)]
    quiet_fit(learn, 1)
    ga = learn.gradient_accumulation
    assert ga.steps >= 2 and all(map(math.isfinite, ga.window_losses))
    bns = _bn_layers(learn)
    if col == 'bn_pool':   # one running-statistics update per optimizer step, from the whole window
        ran = [m for m in bns if m.num_features]   # (fastai's collab net has a BatchNorm of no channels, never called)
        assert [int(m.num_batches_tracked) for m in ran] == [ga.steps]*len(ran)
    if col == 'bn_momentum': assert [m.momentum for m in bns] == momenta   # put back after fit
    if col == 'bn_renorm':
        from accum_callback.batchnorm.norm_layers import BatchRenorm
        assert bns and all(isinstance(m, BatchRenorm) for m in bns)
    if col == 'bn_precise':   # the statistics of the final weights, from 12 training items; and the check of them
        assert next(cb for cb in learn.cbs if isinstance(cb, BatchNormAccumulation)).precise_items >= 12
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='bn_to_groupnorm: .* got one channel per group')
            r = learn.check_batchnorm(12)
        assert len(r.layers) == len([m for m in bns if m.num_features]) and all(map(math.isfinite, r.running + r.precise))
    assert all(math.isfinite(v) for v in learn.validate())

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'lr_find'])
def test_lr_find_cell(name, one_thread):
    "`lr_find` steps once per window of micro-batches (its num_it counts steps) and restores the weights"
    row = ROWS[name]
    learn = build(row, 'lr_find', [GradientAccumulation(n_step=2)])
    w0 = flat(learn.model.parameters()).detach().clone()
    with learn.no_bar(), learn.no_logging(): sug = learn.lr_find(num_it=8, stop_div=False, show_plot=False)
    assert math.isfinite(sug.valley) and learn.gradient_accumulation.steps == 8
    assert torch.equal(flat(learn.model.parameters()).detach(), w0)
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'fine_tune'])
def test_fine_tune_cell(name, one_thread):
    "`fine_tune` (a frozen epoch, then unfrozen) with accumulation and, where there is BatchNorm, 'pool'"
    row = ROWS[name]
    learn = row.make([GradientAccumulation(n_step=2)] + ([BatchNormAccumulation('pool')] if row.bn else []))
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, freeze_epochs=1)
    ga = learn.gradient_accumulation
    assert ga.steps >= 2 and all(map(math.isfinite, ga.window_losses)) and len(learn.recorder.values) == 1

def _close(a, b, tol):
    "Equal strings; numbers within `tol` relative to the largest of `b` (float32's measured rounding: `forward_floor`)"
    if isinstance(a, str): return a == b
    a,b = torch.as_tensor(a).double(),torch.as_tensor(b).double()
    return a.shape == b.shape and bool((a-b).abs().max() <= tol*b.abs().max())

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'inference'])
def test_inference_cell(name, one_thread):
    """After a fit with micro-batches and 'pool': `validate`, `get_preds`, `predict` and `tta` with our callbacks give
    what fastai gives without them"""
    row = ROWS[name]
    ours = [GradientAccumulation(n_step=2), MicroBatching(2)] + ([BatchNormAccumulation('pool')] if row.bn else [])
    learn = row.make(ours)
    quiet_fit(learn, 1)
    with learn.no_bar(): got = _inference(learn, row)
    learn.remove_cbs(ours)
    with learn.no_bar(): want = _inference(learn, row)
    assert got.keys() == want.keys()
    tol = floor_tol([forward_floor(learn, row.loss, row.state64)])
    for k in got: assert all(_close(a, b, tol) for a,b in zip(got[k], want[k])), (k, tol)

def _inference(learn, row):
    out = dict(validate=learn.validate(), get_preds=learn.get_preds(**row.preds_kw)[:2], predict=[row.predict(learn)])
    if row.tta: out['tta'] = learn.tta(n=2)
    return out

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'export'])
def test_export_cell(name, tmp_path, one_thread):
    "`learn.export` with our callbacks on the Learner; `load_learner` predicts the same"
    row = ROWS[name]
    learn = row.make([GradientAccumulation(n_step=2), MicroBatching(2)] + ([BatchNormAccumulation('pool')] if row.bn else []))
    learn.path = tmp_path
    quiet_fit(learn, 1)
    learn.export('export.pkl')
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='load_learner` uses Python')
        loaded = load_learner(tmp_path/'export.pkl')
    tol = floor_tol([forward_floor(learn, row.loss, row.state64)])
    with learn.no_bar(), loaded.no_bar(): assert _close(row.predict(loaded), row.predict(learn), tol), tol

@pytest.fixture(scope='module')
def ddp_runs():
    import ddp_worker
    return launch_gloo(ddp_worker.app_cells, kwargs=dict(names=[n for n,c in CELLS if c == 'ddp']), timeout=120)

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'ddp'])
def test_ddp_cell(name, ddp_runs):
    "fastai's `distrib_ctx` on 2 gloo processes: every step equals one batch of both ranks' windows"
    for rank,res in enumerate(ddp_runs):
        r = res[name]
        assert r['steps'] >= 2 and len(r['errs']) == r['steps'] == r['ddp_steps'], (rank, r)   # every step under DDP
        assert sum(r['sizes']) == N_TRAIN//2, (rank, r)   # DistributedDL: each rank half the samples
        assert max(r['errs']) <= r['tol'], (rank, r['errs'], r['tol'])
        assert r['check'], f'rank {rank}: the check says NOT exact'

@pytest.mark.parametrize('name', [n for n,c in CELLS if c == 'noise_scale'])
def test_noise_scale_cell(name, one_thread):
    """`GradientNoiseScale` measures every window of two micro-batches (finite squared norms, sizes in the row's items),
    and `learn.noise_scale()` measures at the current weights without changing them"""
    from accum_callback import GradientNoiseScale
    row,noise = ROWS[name],GradientNoiseScale()
    learn = build(row, 'noise_scale', [GradientAccumulation(n_step=2), noise])
    quiet_fit(learn, 1)
    ga = learn.gradient_accumulation
    full = [m for m in ga.window_micro if m == 2]
    assert len(noise.values('g2')) == len(full) >= 2 and all(map(math.isfinite, noise.values('g_small2') + noise.values('g_big2')))
    w = flat(learn.model.parameters()).detach().clone()
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='bn_to_groupnorm: .* got one channel per group')
        r = learn.noise_scale(n_windows=2, n_step=2)
    assert r.n_windows == 2 and torch.equal(flat(learn.model.parameters()).detach(), w)

# -- the table in docs/fastai.md -----------------------------------------------------------------------------------
def matrix_markdown()->str:
    "The matrix as docs/fastai.md shows it: one line per feature (column of the tests), one column per application"
    lines = ['| feature | ' + ' | '.join(f'`{n}`' for n in ROWS) + ' |', '|---|' + '---|'*len(ROWS)]
    for c in COLUMNS:
        cells = []
        for n in ROWS:
            if not applies(ROWS[n], c): cells.append('n/a'); continue
            o,causes = expected(n, c)
            cells.append(o if o != 'differs' else 'differs: ' + ', '.join(sorted(causes)))
        lines.append(f'| `{c}` | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)

DOC = Path(__file__).resolve().parents[1]/'docs'/'fastai.md'
START,END = '<!-- matrix: generated by `python tests/test_matrix.py` -->', '<!-- /matrix -->'

def test_docs_table_is_the_matrix():
    text = DOC.read_text()
    assert START in text and END in text, 'docs/fastai.md has no matrix table'
    assert text[text.index(START)+len(START):text.index(END)].strip() == matrix_markdown(), \
        'docs/fastai.md: the matrix table is stale, run `python tests/test_matrix.py`'

if __name__ == '__main__':
    text = DOC.read_text()
    i,j = text.index(START)+len(START),text.index(END)
    DOC.write_text(text[:i] + '\n' + matrix_markdown() + '\n' + text[j:])
    print(f'wrote the matrix into {DOC}')
