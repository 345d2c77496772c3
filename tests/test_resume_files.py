"""A checkpoint the package cannot apply (issue 61, items 3-5 and 9): well framed (magic, length, CRC-32 all valid) but
malformed inside, of another structure, asking for a huge array, or left half-written by a kill. Each is passed over with
one warning and the newest good one resumed, the same run as if the bad file had never been there; never a traceback,
never code run, never a large allocation; an old checkpoint that cannot be removed is a warning, not the end of training."""
import io, struct, warnings, zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from accum_callback import Checkpoint, GradientAccumulation
from accum_callback.resume.format import _MAGIC, CheckpointError, _unpack, read_checkpoint
from helpers import make_data, make_learner
from test_resume import Boom, RaiseAt

TAG = '__accum_callback__'

def _data(): return make_data(40, seed=4)

def _interrupted(folder:Path):
    "Two checkpoints of a fit cut at its 7th batch (`every=('1ep', '2ba')`, `keep=2`)"
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(folder, every=('1ep', '2ba')), RaiseAt(7)])
    with learn.no_bar(), learn.no_logging(), pytest.raises(Boom): learn.fit(2)
    files = sorted(folder.glob('ckpt-*.rank0.pt'))
    assert len(files) == 2
    return files

def _plain(f:Path, unpack:bool=True):
    """A checkpoint file's contents as written (the plain structure, tags and all), read without running code; `unpack`:
    its small tensors put back in their places (what a file written without a pack holds: the format reads both)"""
    raw = f.read_bytes()
    st = torch.load(io.BytesIO(raw[len(_MAGIC) + 12:]), weights_only=True)
    if not (unpack and isinstance(st, dict) and st.get(TAG) == 'pack'): return st
    value,small = _unpack(st)
    def put(o):
        if isinstance(o, dict): return small[o['i']] if o.get(TAG) == 'packed' else type(o)((k, put(v)) for k,v in o.items())
        return type(o)(put(v) for v in o) if type(o) in (list, tuple) else o
    return put(value)

def _frame(f:Path, obj):
    "Write `obj` as a well-framed checkpoint: magic, CRC-32 and length all valid, whatever it holds"
    buf = io.BytesIO(); torch.save(obj, buf); data = buf.getvalue()
    f.write_bytes(_MAGIC + struct.pack('<IQ', zlib.crc32(data), len(data)) + data)

def _resume(folder:Path):
    "Run the fit again with a Checkpoint on `folder`: (its Checkpoint, the final weights, the warnings said)"
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(folder)])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
    return cb,[p.detach().clone() for p in learn.model.parameters()],[str(w.message) for w in said if 'Checkpoint' in str(w.message)]

@pytest.fixture(scope='module')
def from_the_older(tmp_path_factory):
    "The weights a resume from the older of the two checkpoints gives (the newest removed): what passing over must give"
    folder = tmp_path_factory.mktemp('older')
    files = _interrupted(folder)
    files[-1].unlink()
    cb,w,_ = _resume(folder)
    assert cb.resumed_from == files[0]
    return w

def _tag_in(o, kind:str):
    "The path (keys) to the first tagged dict of `kind` in the plain structure `o`"
    if isinstance(o, dict):
        if o.get(TAG) == kind: return []
        items = o.items()
    elif isinstance(o, (list, tuple)): items = enumerate(o)
    else: return None
    for k,v in items:
        p = _tag_in(v, kind)
        if p is not None: return [k, *p]
    return None

def _at(o, path):
    for k in path: o = o[k]
    return o

# each: (the tag it damages, how), as issue 61 found them
MALFORMED = {
    "'tensor' tag holding no tensor": ('ndarray', lambda d: d.update({TAG: 'tensor', 'type': 'fastai.torch_core.TensorBase', 'value': [1, 2]})),
    'ndarray without a shape': ('ndarray', lambda d: d.pop('shape')),
    'ndarray of the wrong shape': ('ndarray', lambda d: d.update(shape=[3, 5])),
    'ndarray of an unknown dtype': ('ndarray', lambda d: d.update(dtype='float1024')),
    'ndarray of a 500 MB string dtype': ('ndarray', lambda d: d.update(dtype='U125000000', shape=[1], value=[0])),
    'ndarray of objects': ('ndarray', lambda d: d.update(dtype='O')),
    "'L' tag that is not a list": ('ndarray', lambda d: d.update({TAG: 'L', 'value': 7})),
    'unknown tag': ('ndarray', lambda d: d.update({TAG: 'pickle'})),
}

@pytest.mark.parametrize('case', list(MALFORMED))
def test_a_well_framed_but_malformed_newest_is_passed_over_with_one_warning(tmp_path, case, from_the_older):
    files = _interrupted(tmp_path/'ck')
    kind,damage = MALFORMED[case]
    st = _plain(files[-1])
    path = _tag_in(st, kind)
    assert path is not None, f'no {kind} tag in the checkpoint'
    damage(_at(st, path))
    _frame(files[-1], st)
    with pytest.raises(CheckpointError): read_checkpoint(files[-1])   # (read alone: refused, naming it)
    cb,w,said = _resume(tmp_path/'ck')
    assert cb.resumed_from == files[0]
    assert all(torch.equal(a, b) for a,b in zip(w, from_the_older)), 'not the run the older checkpoint gives'
    assert len([s for s in said if 'passed over' in s]) == 1, said

STRUCTURES = {
    'a list at the top': lambda st: [st],
    'no signature': lambda st: {k: v for k,v in st.items() if k != 'signature'},
    'no model': lambda st: {k: v for k,v in st.items() if k != 'model'},
    "'where' unknown": lambda st: {**st, 'where': 'elsewhere'},
    'a gradient of another shape': lambda st: {**st, 'grads': [torch.zeros(3) for _ in st['grads']]},
    'a model tensor of another shape': lambda st: {**st, 'model': {k: torch.zeros(1) for k in st['model']}},
    'the RNGs malformed': lambda st: {**st, 'rngs': [1, 2]},
    "a callback's state malformed": lambda st: {**st, 'callbacks': {k: {'window': 3} for k in st['callbacks']}},
    'the Recorder malformed': lambda st: {**st, 'recorder': {'smooth': 1}},
    'a key the Recorder does not declare': lambda st: {**st, 'recorder': {**st['recorder'], 'after_batch': torch.zeros(1)}},
    "the window's phase unknown": lambda st: _window(st, phase='no such phase'),
    "a step record with a missing field": lambda st: _window(st, record=[4, 4.0, 1.0]),
}

def _window(st, **change):
    "The plain state `st` with its window's fields changed (the window's state is plain: its phase a string, its record a list)"
    ga = next(k for k in st['callbacks'] if 'gradient' in k)
    w = {**st['callbacks'][ga]['window'], **change}
    return {**st, 'callbacks': {**st['callbacks'], ga: {**st['callbacks'][ga], 'window': w}}}

def test_a_tag_the_format_does_not_know_is_refused_naming_it(tmp_path):
    "0.2's tagged phase ('enum') is a tag the 0.3 format no longer reads: refused naming the tag, the one before resumed"
    files = _interrupted(tmp_path/'ck')
    st = _plain(files[-1])
    _frame(files[-1], _window(st, phase={TAG: 'enum', 'type': 'accum_callback.window.Phase', 'value': 'idle'}))
    with pytest.raises(CheckpointError, match="unknown tag 'enum'"): read_checkpoint(files[-1])

@pytest.mark.parametrize('case', list(STRUCTURES))

def test_a_newest_of_another_structure_is_passed_over(tmp_path, case, from_the_older):
    files = _interrupted(tmp_path/'ck')
    _frame(files[-1], STRUCTURES[case](_plain(files[-1])))
    cb,w,said = _resume(tmp_path/'ck')
    assert cb.resumed_from == files[0] and all(torch.equal(a, b) for a,b in zip(w, from_the_older))
    assert len([s for s in said if 'passed over' in s]) == 1, said

def test_a_restore_sets_only_the_attributes_each_piece_declares(tmp_path):
    """Names a file plants inside a piece's state (the smoothed loss's `accumulate`, a window log's `learn`) are not set:
    the newest is resumed, and the Learner works as before (a planted `Recorder.after_batch` once stopped the resumed fit
    recording losses: a Recorder state with a key it does not declare is passed over whole, `STRUCTURES` above)"""
    files = _interrupted(tmp_path/'ck')
    st = _plain(files[-1])
    st['recorder']['smooth']['accumulate'] = 1
    ga = next(k for k in st['callbacks'] if 'gradient' in k)
    st['callbacks'][ga]['logs']['learn'] = 5
    _frame(files[-1], st)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck')])
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    assert cb.resumed_from == files[-1]
    assert callable(learn.recorder.smooth_loss.accumulate)
    assert learn.gradient_accumulation.learn is learn and len(learn.recorder.losses) == 20

# -- fuzz: the plain structure and the bytes ---------------------------------------------------------------------------
def _nodes(o, path=()):
    "Every place in the plain structure: (path, value)"
    yield path, o
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, (list, tuple)) else ()
    for k,v in items: yield from _nodes(v, (*path, k))

def _replace(o, path, new):
    if not path: return new
    k,rest = path[0],path[1:]
    if isinstance(o, dict): return {**o, k: _replace(o[k], rest, new)}
    out = list(o); out[k] = _replace(o[k], rest, new)
    return type(o)(out)

VALUES = st.one_of(st.none(), st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.text(max_size=8), st.booleans(),
                   st.lists(st.integers(0, 3), max_size=3), st.just({TAG: 'ndarray', 'dtype': 'U99999999', 'shape': [1], 'value': [1]}),
                   st.just({TAG: 'enum'}), st.just({}), st.builds(torch.zeros, st.integers(0, 3)))

@pytest.fixture(scope='module')
def fuzz_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp('fuzz')
    files = _interrupted(folder/'ck')
    return folder,[f.read_bytes() for f in files],_plain(files[-1])

@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_newest_is_resumed_or_passed_over_never_a_traceback(fuzz_base, data, tmp_path_factory):
    """Any value anywhere in the newest checkpoint's structure: resumed from it, passed over to the older (one warning),
    or, where the value lands in the signature (what the fit must share with the checkpoint's), one refusal naming it"""
    folder,raws,plain = fuzz_base
    ck,names = _two_checkpoints(tmp_path_factory, raws)
    path,_ = data.draw(st.sampled_from(list(_nodes(plain))[1:]), label='where')
    _frame(ck/names[-1], _replace(plain, path, data.draw(VALUES, label='value')))
    _resumed_passed_over_or_refused(ck, names, path)

def _two_checkpoints(tmp_path_factory, raws):
    "A folder of its own holding the fuzz base's two checkpoints, and their names (the older first)"
    ck = tmp_path_factory.mktemp('case')/'ck'; ck.mkdir()
    names = ['ckpt-000001.rank0.pt', 'ckpt-000002.rank0.pt']
    for n,raw in zip(names, raws): (ck/n).write_bytes(raw)
    return ck,names

def _resumed_passed_over_or_refused(ck, names, path):
    "The fit run again on `ck`: resumed from the newest, or from the older with one warning, or (the newest's signature changed at `path`) refused naming it"
    try: cb,_,said = _resume(ck)
    except CheckpointError as e:
        assert 'signature' in path and 'ckpt-000002' in str(e) and ('cannot resume' in str(e) or 'other shapes' in str(e)), (path, e)
        return
    assert cb.resumed_from in (ck/names[0], ck/names[1])
    assert len([s for s in said if 'passed over' in s]) == (cb.resumed_from == ck/names[0]), said

@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bytes_under_a_valid_crc_never_a_traceback(fuzz_base, data, tmp_path_factory):
    "Bytes changed under a CRC made again: resumed, passed over, or (the signature changed) one refusal naming the file"
    folder,raws,_ = fuzz_base
    ck = tmp_path_factory.mktemp('case')/'ck'; ck.mkdir()
    (ck/'ckpt-000001.rank0.pt').write_bytes(raws[0])
    body = bytearray(raws[1][len(_MAGIC) + 12:])
    for _ in range(data.draw(st.integers(1, 8))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    (ck/'ckpt-000002.rank0.pt').write_bytes(_MAGIC + struct.pack('<IQ', zlib.crc32(bytes(body)), len(body)) + bytes(body))
    try: cb,_,_ = _resume(ck)
    except CheckpointError as e:   # bytes that rewrote the signature: a checkpoint of another fit, refused naming it
        assert 'ckpt-000002' in str(e) and ('cannot resume' in str(e) or 'other shapes' in str(e)), e
        return
    assert cb.resumed_from in (ck/'ckpt-000001.rank0.pt', ck/'ckpt-000002.rank0.pt')

# -- the folder: cleanup that fails, leftovers of kills -----------------------------------------------------------------
def test_an_old_checkpoint_that_cannot_be_removed_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    real = Path.unlink
    def stuck(self, *a, **k):
        if self.name.startswith('ckpt-'): raise PermissionError(1, 'Operation not permitted', str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(Path, 'unlink', stuck)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck', every=('1ep', '2ba'))])
    with pytest.warns(UserWarning, match='could not remove the old checkpoint.*PermissionError.*training goes on'):
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
    assert learn.gradient_accumulation.steps == 10 and len(cb.saved) > 2

def test_what_a_killed_write_left_is_removed_at_fit_start_and_nothing_else(tmp_path):
    import os
    ck = tmp_path/'ck'; ck.mkdir()
    dead = ck/'.ckpt-000003.rank0.pt.x1y2.999999999.part'   # (no such process)
    alive = ck/f'.ckpt-000003.rank1.pt.a1b2.{os.getpid()}.part'   # another writer, still running
    other = ck/'.notes.999999999.part'
    for f in (dead, alive, other): f.write_bytes(b'x')
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(ck)])
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert not dead.exists() and alive.exists() and other.exists()

def test_dcp_metadata_of_the_wrong_structure_is_a_checkpoint_error(tmp_path):
    import pickle
    from torch.distributed.checkpoint.metadata import Metadata
    from accum_callback.resume.sharded import read_dcp_metadata
    (tmp_path/'.metadata').write_bytes(pickle.dumps(Metadata(state_dict_metadata=[])))
    with pytest.raises(CheckpointError, match='state_dict_metadata is a list'): read_dcp_metadata(tmp_path/'.metadata')

# -- the signature holds the data (issue 61, item 2) ---------------------------------------------------------------------
def test_another_notebook_on_other_data_in_the_same_folder_is_refused_naming_the_data(tmp_path):
    "Two notebooks, one default folder: a fit on other data of the same shapes and arguments is refused, not resumed"
    from accum_callback.resume.fit_state import data_identity
    files = _interrupted(tmp_path/'ck')
    other = make_data(40, seed=5)   # the same shapes, other samples
    learn = make_learner(other, 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck')])
    assert data_identity(learn.dls.train) != data_identity(make_learner(_data(), 4).dls.train)
    with learn.no_bar(), learn.no_logging(), pytest.raises(CheckpointError, match=r"data: '40 items, CRC-32 \w+' then, '40 items, CRC-32 \w+' now"):
        learn.fit(2)
    same = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck')])
    with same.no_bar(), same.no_logging(): same.fit(2)
    assert cb.resumed_from == files[-1]

# -- a notebook's several fits, re-run after a kernel restart (issue 61, item 1) ---------------------------------------------
from fastai.callback.core import Callback
from fastai.callback.schedule import LRFinder

class StopButton(Callback):
    "The notebook's stop button at the `at`-th training batch of the fits (lr_find's not counted; None: never)"
    order = 99
    def __init__(self, at:int|None): self.at,self.k = at,0
    def after_batch(self):
        if self.training and not any(isinstance(c, LRFinder) for c in self.learn.cbs):
            self.k += 1
            if self.k == self.at: raise Boom('the stop button')

def _notebook(folder:Path, cut_at:int|None=None):
    """The cells: fit_one_cycle(1) -> lr_find -> fit_one_cycle(2, valley), `Checkpoint(every=('1ep', '1ba'))`, on a fresh Learner
    (a kernel restart); `cut_at`: the stop button at that training batch of the session. Returns what each cell left"""
    from fastai.callback.schedule import valley
    from fastai.torch_core import set_seed
    set_seed(0)
    cbs = [GradientAccumulation(n_step=3), Checkpoint(folder, every=('1ep', '1ba'))] + ([StopButton(cut_at)] if cut_at else [])
    learn = make_learner(_data(), 4, cbs=cbs, shuffle=True)
    out = {}
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            learn.fit_one_cycle(1, 0.05); out['fit1'] = [p.detach().clone() for p in learn.model.parameters()]
            out['lr'] = learn.lr_find(suggest_funcs=valley, show_plot=False).valley
            learn.fit_one_cycle(2, out['lr']); out['fit2'] = [p.detach().clone() for p in learn.model.parameters()]
        except Boom: out['cut'] = True
    return out

def test_a_notebook_of_several_fits_re_run_after_a_restart_is_the_uninterrupted_session(tmp_path):
    """Stopped in the second fit, the kernel restarted, the cells re-run from the top: the first fit's cell restores the
    model as that fit ended (it was at its initial weights: max |diff| 8.0), `lr_find` sees it and finds the same valley,
    and the second fit resumes where it stopped: the uninterrupted session's weights, bitwise"""
    ref = _notebook(tmp_path/'ref')
    cut = _notebook(tmp_path/'ck', cut_at=10 + 5)   # (10 training batches an epoch: the 5th of the second fit)
    assert cut.get('cut') and 'fit1' in cut and 'fit2' not in cut
    again = _notebook(tmp_path/'ck')
    assert all(torch.equal(a, b) for a,b in zip(again['fit1'], ref['fit1'])), "the first fit's cell did not restore its end"
    assert again['lr'] == ref['lr']
    assert all(torch.equal(a, b) for a,b in zip(again['fit2'], ref['fit2'])), 'the second fit did not resume to the uninterrupted weights'

# -- state a feature keeps outside the model's state dict (issue 61, item 8) ----------------------------------------------
@pytest.mark.parametrize('kw', [dict(), dict(warmup=2, ramp=10)], ids=['defaults', 'warmup-ramp'])
def test_batch_renorm_resumes_its_ramp_bitwise(tmp_path, kw):
    """`BatchNormAccumulation('renorm')`: each layer's count of training forwards drives r_max/d_max's ramp; resumed at
    0 it was 5.8e-4 (defaults) and 4.0e-3 (warmup=2, ramp=10) off. Cut mid-window and resumed: bitwise, counts equal"""
    import torch.nn as nn
    from accum_callback import BatchNormAccumulation, Renorm
    from accum_callback.batchnorm.norm_layers import BatchRenorm
    def run(folder, cut=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        cbs = [GradientAccumulation(n_step=2), BatchNormAccumulation(Renorm(**kw)), Checkpoint(folder, every=('1ep', '1ba'))]
        learn = make_learner(_data(), 4, model=model, cbs=cbs + ([RaiseAt(cut)] if cut else []))
        with learn.no_bar(), learn.no_logging():
            try: learn.fit(2, 0.05)
            except Boom: return None
        return learn
    ref = run(tmp_path/'ref')
    assert run(tmp_path/'ck', cut=13) is None
    again = run(tmp_path/'ck')
    steps = lambda l: [m.renorm_steps for m in l.model.modules() if isinstance(m, BatchRenorm)]
    assert steps(again) == steps(ref) and steps(ref)[0] > 0
    a,b = ref.model.state_dict(),again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), 'weights or statistics differ from the uninterrupted run'

# -- generative: any notebook of fits, stopped anywhere, re-run from the top ---------------------------------------------
CELLS = st.lists(st.tuples(st.sampled_from(['fit', 'fit_one_cycle', 'fit_flat_cos']), st.integers(1, 2),
                           st.sampled_from([None, 'lr_find', 'validate', 'freeze'])), min_size=1, max_size=3)

def _session(folder:Path, cells, stop_at:int|None=None):
    """Run the notebook `cells` (a fit of each kind and epochs, then maybe `lr_find`/`validate`/a freeze) on a fresh
    Learner with `Checkpoint(every=('1ep', '1ba'))`; `stop_at`: the stop button at that training batch of the fits. Returns each
    fit's end weights and the cut, if any"""
    from fastai.callback.schedule import valley
    from fastai.torch_core import set_seed
    set_seed(0)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=3), Checkpoint(folder, every=('1ep', '1ba')), StopButton(stop_at)], shuffle=True)
    ends,lr = [],0.05
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            for meth,epochs,then in cells:
                getattr(learn, meth)(epochs, lr)
                ends.append([p.detach().clone() for p in learn.model.parameters()])
                if then == 'lr_find': lr = learn.lr_find(suggest_funcs=valley, show_plot=False).valley
                elif then == 'validate': ends.append([torch.tensor(v) for v in learn.validate()])
                elif then == 'freeze': learn.model.l1.requires_grad_(False)
        except Boom: return ends,True
    return ends,False

@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cells=CELLS, data=st.data())
def test_any_notebook_stopped_anywhere_and_re_run_is_the_uninterrupted_session(cells, data, tmp_path_factory):
    """Fits of any kind and length, with lr_find, validate or a freeze between them, the stop button at any training
    batch, the kernel restarted and every cell re-run: each fit ends with the uninterrupted session's weights, bitwise"""
    ref,_ = _session(tmp_path_factory.mktemp('ref'), cells)
    total = sum(10*e for _,e,_ in cells)   # (10 training batches an epoch)
    stop = data.draw(st.integers(1, total), label='stop at')
    folder = tmp_path_factory.mktemp('cut')
    _,cut = _session(folder, cells, stop_at=stop)
    assert cut
    again,cut = _session(folder, cells)
    assert not cut and len(again) == len(ref)
    for i,(a,b) in enumerate(zip(again, ref)):
        assert all(torch.equal(x, y) for x,y in zip(a, b)), f'cell {i} differs from the uninterrupted session (stopped at batch {stop})'

def test_long_lists_rng_states_and_the_signature_are_single_objects_and_read_back_exactly():
    """A checkpoint a step of a long fit writes its growing logs (window sizes, losses, learning rates), Python's and
    numpy's RNG states and the signature as one tensor or one JSON text each, not an object per number; read back
    exactly (NaN and inf too), and a malformed one is refused, never applied"""
    import math, random, numpy as np
    from accum_callback.resume.format import AsJson, plain_state, from_plain, json_normal
    floats = [random.random() for _ in range(200)] + [math.nan, math.inf, -0.0]
    st = dict(f=floats, i=tuple(range(-5, 300)), py=random.getstate(), np=np.random.get_state(),
              sig=AsJson({'fit': 1, 'model': [('w', (3, 4))]}), short=[1.5, 2.5], mixed=[1]*70 + [2.0])
    p = plain_state(st)
    assert isinstance(p['f'], dict) and isinstance(p['i'], dict) and isinstance(p['py'][1], dict) and isinstance(p['sig'], dict)
    assert p['short'] == [1.5, 2.5] and isinstance(p['mixed'], list)   # (short or mixed lists as they are)
    back = from_plain(p)
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a,b in zip(back['f'], floats)) and len(back['f']) == len(floats)
    assert back['i'] == st['i'] and back['py'] == st['py'] and back['sig'] == json_normal({'fit': 1, 'model': [('w', (3, 4))]})
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a,b in zip(back['np'], st['np']))
    for bad in ({**p['f'], 'value': torch.zeros(3, dtype=torch.int64)}, {**p['i'], 'type': 'set'},
                {**p['sig'], 'value': '{"fit": '}, {**p['np'][1], 'value': torch.full((624,), -1, dtype=torch.int64)}):
        with pytest.raises(CheckpointError): from_plain(bad)

# -- the pack: a checkpoint's small tensors in one flat tensor per dtype -------------------------------------------------
def _write_read(tmp_path, state):
    from accum_callback.resume.format import write_checkpoint
    write_checkpoint(tmp_path/'c.pt', state)
    return read_checkpoint(tmp_path/'c.pt'),_plain(tmp_path/'c.pt', unpack=False)

def test_small_tensors_are_packed_and_read_back_exactly_each_its_own():
    """Every dtype the pack takes, 0-d, empty, up to 16 KiB, a fastai typed tensor, the RNG states: read back equal
    (bitwise, the same dtype and shape), each a tensor with a storage of its own (torch's RNG reads a view's storage from
    its start: the CPU RNG's state read back is set, and draws as before); the large, the non-contiguous (channels_last)
    and others as they were"""
    import random, tempfile, numpy as np
    from fastai.torch_core import TensorImage
    from accum_callback.compat.torch import rng_states, set_rng_states
    g = torch.Generator().manual_seed(0)
    small = {str(d): (torch.randn(3, 5, generator=g)*100).to(d) for d in (torch.float32, torch.float64, torch.float16,
             torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
    others = dict(zero_d=torch.tensor(2.5), empty=torch.zeros(0, 4), edge=torch.randn(4096, generator=g),
                  large=torch.randn(4097, generator=g), cl=torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
                  cplx=torch.randn(3, dtype=torch.complex64, generator=g), img=TensorImage(torch.rand(1, 2, 2, generator=g)),
                  param=torch.nn.Parameter(torch.ones(3)))
    state = dict(small=small, **others, rngs=rng_states(), nested=[(small['torch.float32'], 1), {'k': small['torch.int8']}])
    with tempfile.TemporaryDirectory() as d:
        back,raw = _write_read(Path(d), state)
    assert raw.get(TAG) == 'pack' and set(raw['data']) == {str(t).removeprefix('torch.') for t in small.values() for t in [t.dtype]}
    assert raw['value']['large'].shape == (4097,) and isinstance(raw['value']['edge'], dict)   # (16 KiB packed, more not)
    assert torch.is_tensor(raw['value']['cl']) and torch.is_tensor(raw['value']['cplx'])   # (not contiguous, not a packed dtype)
    def same(a, b): return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    for k,t in small.items(): assert same(back['small'][k], t) and back['small'][k].untyped_storage().nbytes() == t.nbytes, k
    for k in ('zero_d', 'empty', 'edge', 'large', 'cplx'): assert same(back[k], others[k]), k
    assert same(back['cl'], others['cl']) and back['cl'].is_contiguous(memory_format=torch.channels_last)
    assert type(back['img']) is TensorImage and torch.equal(back['img'], others['img']) and same(back['param'], torch.ones(3))
    assert same(back['nested'][0][0], small['torch.float32']) and back['nested'][0][1] == 1 and same(back['nested'][1]['k'], small['torch.int8'])
    set_rng_states(back['rngs']); a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_states(state['rngs']); b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])

PACKS = {   # what a pack can hold that does not fit it: each a `CheckpointError`, never a view outside its data
    'a row past its data': lambda p: p['index'][0].__setitem__(1, 10**6),
    'a negative offset': lambda p: p['index'][0].__setitem__(1, -1),
    'a negative dimension': lambda p: p['index'][0].__setitem__(3, -2) if p['index'].shape[1] > 3 else p['index'][0].__setitem__(2, -1),
    'a dimension of 2**62': lambda p: p['index'][0].__setitem__(2, 1) or p['index'][0].__setitem__(3, 2**62),
    'more dimensions than columns': lambda p: p['index'][0].__setitem__(2, 99),
    'an unknown dtype place': lambda p: p['index'][0].__setitem__(0, 77),
    'a dtype with no data': lambda p: p['data'].pop(next(iter(p['data']))),
    'data of another dtype': lambda p: p['data'].__setitem__(next(iter(p['data'])), torch.zeros(4, dtype=torch.complex64)),
    'data of 2 dimensions': lambda p: p['data'].__setitem__('float32', p['data']['float32'].view(1, -1)),
    'an index of floats': lambda p: p.__setitem__('index', p['index'].double()),
    'an index of 1 dimension': lambda p: p.__setitem__('index', p['index'].flatten()),
    'no index': lambda p: p.pop('index'),
    'a value that is a list': lambda p: p.__setitem__('value', [p['value']]),
    'a placeholder past the pack': lambda p: p['value']['model'].__setitem__(next(iter(p['value']['model'])), {TAG: 'packed', 'i': 10**6}),
    'a placeholder of a string': lambda p: p['value']['model'].__setitem__(next(iter(p['value']['model'])), {TAG: 'packed', 'i': '0'}),
    'a placeholder in an unpacked file': lambda p: p.update(p.pop('value')) or p.pop(TAG) and None,
}

@pytest.mark.parametrize('case', list(PACKS))
def test_a_malformed_pack_is_passed_over_with_one_warning(tmp_path, case, from_the_older):
    files = _interrupted(tmp_path/'ck')
    p = _plain(files[-1], unpack=False)
    assert p.get(TAG) == 'pack'
    PACKS[case](p)
    _frame(files[-1], p)
    with pytest.raises(CheckpointError): read_checkpoint(files[-1])
    cb,w,said = _resume(tmp_path/'ck')
    assert cb.resumed_from == files[0] and len([s for s in said if 'passed over' in s]) == 1, said
    assert all(torch.equal(a, b) for a,b in zip(w, from_the_older))

@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_pack_is_resumed_or_passed_over_never_a_traceback(fuzz_base, data, tmp_path_factory):
    "Any number in the pack's index, or any value anywhere in the packed structure: resumed, passed over, or one refusal"
    folder,raws,_ = fuzz_base
    ck,names = _two_checkpoints(tmp_path_factory, raws)
    p = _plain(ck/names[-1], unpack=False)
    if data.draw(st.booleans(), label='an index cell'):
        r,c = data.draw(st.integers(0, p['index'].shape[0] - 1)),data.draw(st.integers(0, p['index'].shape[1] - 1))
        p['index'][r, c] = data.draw(st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**62, -2**62])), label='number')
        path = ('index',)
    else:
        path,_ = data.draw(st.sampled_from(list(_nodes(p))[1:]), label='where')
        p = _replace(p, path, data.draw(VALUES, label='value'))
    _frame(ck/names[-1], p)
    _resumed_passed_over_or_refused(ck, names, path)
