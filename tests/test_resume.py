"""(Modules `checkpoint`, `checkpoint_format`, `fit_state`, `fit_place`, `loaders`, `files`.) Stop anywhere, resume to the same weights (issue 37): a fit killed with SIGKILL at points drawn at random (mid-window,
inside a 'carry' window, between a micro-batch's backward and the step, in the middle of a checkpoint's write) and run
again ends with weights, optimizer state, BatchNorm buffers, the Recorder's losses and the step count bitwise equal to
the uninterrupted fit's (CPU, one thread); a cut or damaged checkpoint is never loaded; a resume that cannot be exact is
refused naming what changed. One draw of points per configuration in the default run, twelve behind `-m slow`."""
import contextlib, json, random, signal, subprocess, sys, time, warnings, zlib
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from accum_callback import Checkpoint, GradientAccumulation, MicroBatching
from accum_callback.resume.checkpoint import CheckpointError, _MAGIC, read_checkpoint
from helpers import accumulation, make_learner, make_data

WORKER = Path(__file__).with_name('resume_worker.py')
EVENTS = ('before_batch', 'after_pred', 'after_backward', 'before_step', 'after_step', 'after_batch', 'in_save',
          'sigterm_after_backward')

def points(seed:int, n:int)->list:
    "`n` kill points: an event and the micro-batch of the run (from 1) it is reached at; at least one cut write"
    rng = random.Random(seed)
    out = [('in_save', rng.randint(1, 3))] + [(rng.choice(EVENTS), rng.randint(1, 9)) for _ in range(n-1)]
    rng.shuffle(out)
    return out

def resumed(tmp_path, config, pts, meth='fit'):
    out = tmp_path/config
    r = subprocess.run([sys.executable, str(WORKER), config, str(out), json.dumps(pts), meth], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out/'result.pt', weights_only=False)

def assert_same(res):
    a,b = res['ref'],res['final']
    diff = [k for k in a['model'] if not torch.equal(a['model'][k], b['model'][k])]
    assert not diff, f"kills {res['kills']}: weights or buffers differ from the uninterrupted run: {diff}"
    assert len(a['opt']) == len(b['opt']) and all(torch.equal(x[k], y[k]) for x,y in zip(a['opt'], b['opt']) for k in x), 'optimizer state differs'
    assert a['steps'] == b['steps'] and a['losses'] == b['losses'] and a['values'] == b['values'], 'steps or the Recorder differ'
    assert sum(c == -9 for _,_,c in res['kills']) >= 1, f"no run was killed: {res['kills']}"

CONFIGS = [('n_step', 'fit'), ('carry_pool', 'fit_one_cycle'), ('noise', 'fit'), ('auto_oom', 'fit'),
           ('momentum', 'fit'), ('n_step', 'fine_tune')]

@pytest.mark.parametrize('config,meth', CONFIGS, ids=[f'{c}-{m}' for c,m in CONFIGS])
def test_killed_and_resumed_is_bitwise_the_uninterrupted_fit(tmp_path, config, meth):
    assert_same(resumed(tmp_path, config, points(zlib.crc32(f'{config}{meth}'.encode()), 4), meth))

@pytest.mark.slow
@pytest.mark.parametrize('config,meth', CONFIGS, ids=[f'{c}-{m}' for c,m in CONFIGS])
def test_twelve_kills_each(tmp_path, config, meth):
    assert_same(resumed(tmp_path, config, points(7 + zlib.crc32(f'{config}{meth}'.encode()), 12), meth))

# -- in-process: refusals, damaged files -------------------------------------------------------------------------------
class Boom(Exception): pass

class RaiseAt:
    "Raises `Boom` at the `at`-th training batch: the fit ends as a crash would (no `after_fit`)"
    def __new__(cls, at):
        from fastai.callback.core import Callback
        class _R(Callback):
            order = 99
            def __init__(self): self.k = 0
            def after_batch(self):
                if self.training:
                    self.k += 1
                    if self.k == at: raise Boom('the run is cut here')
        return _R()

def _data(n=40): x,y = make_data(n, seed=4).tensors; return TensorDataset(x, y)

def _interrupted(tmp_path, **kw):
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck', every=('1ep', '2ba')), RaiseAt(7)], **kw)
    with learn.no_bar(), learn.no_logging(), pytest.raises(Boom): learn.fit(2)
    return tmp_path/'ck'

@pytest.mark.parametrize('change,named', [
    (dict(cbs=[GradientAccumulation(n_step=3)]), 'window'),
    (dict(bs=5), 'training loader'),
    (dict(n_epoch=3), 'n_epoch'),
    (dict(cbs=[GradientAccumulation(n_step=2), MicroBatching(2)]), 'micro_bs'),
])
def test_a_resume_that_cannot_be_exact_is_refused_naming_what_changed(tmp_path, change, named):
    ck = _interrupted(tmp_path)
    learn = make_learner(_data(), change.get('bs', 4), cbs=change.get('cbs', [GradientAccumulation(n_step=2)]) + [Checkpoint(ck)])
    with learn.no_bar(), learn.no_logging(), pytest.raises(CheckpointError, match=rf"{named}: .* then, .* now.*strict=False"):
        learn.fit(change.get('n_epoch', 2))
    relaxed = make_learner(_data(), change.get('bs', 4), cbs=change.get('cbs', [GradientAccumulation(n_step=2)]) + [Checkpoint(ck, strict=False)])
    with relaxed.no_bar(), relaxed.no_logging(), pytest.warns(UserWarning, match='strict=False'): relaxed.fit(change.get('n_epoch', 2))

def test_another_model_or_world_size_is_refused(tmp_path, monkeypatch):
    ck = _interrupted(tmp_path)
    from helpers import MLP
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(ck, strict=False)], model=MLP(n_in=5, n_out=3, n_hidden=7))
    with learn.no_bar(), learn.no_logging(), pytest.raises(CheckpointError, match='model of other shapes'): learn.fit(2)
    sig = Checkpoint.signature
    monkeypatch.setattr(Checkpoint, 'signature', lambda self: {**sig(self), 'world size': 2})   # (as on 2 ranks)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(ck)])
    with learn.no_bar(), learn.no_logging(), pytest.raises(CheckpointError, match='world size: 1 then, 2 now'): learn.fit(2)

@pytest.mark.parametrize('damage', ['truncate', 'flip', 'part'])
def test_a_cut_or_damaged_checkpoint_is_never_loaded(tmp_path, damage):
    ck = _interrupted(tmp_path)
    files = sorted(ck.glob('ckpt-*.rank0.pt'))
    assert len(files) == 2   # keep=2
    newest = files[-1]
    raw = newest.read_bytes()
    if damage == 'truncate': newest.write_bytes(raw[:len(raw)//2])
    elif damage == 'flip': newest.write_bytes(raw[:-100] + bytes([raw[-100] ^ 0xFF]) + raw[-99:])
    else: newest.unlink(); (ck/f'.{newest.name}.123.part').write_bytes(raw[:100])   # a write the kill cut: never renamed
    if damage != 'part':
        with pytest.raises(CheckpointError): read_checkpoint(newest)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(ck)])
    with warnings.catch_warnings(record=True) as said, learn.no_bar(), learn.no_logging():
        warnings.simplefilter('always'); learn.fit(2)
    assert cb.resumed_from == files[0]
    passed = [str(w.message) for w in said if 'passed over' in str(w.message)]
    assert len(passed) == (damage != 'part') and all(newest.name in p for p in passed), passed   # (one line, naming it)

def test_a_finished_fit_is_not_run_again_and_a_fresh_start_is_asked_for(tmp_path):
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck')])
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    w = [p.detach().clone() for p in learn.model.parameters()]
    again = make_learner(_data(), 4, seed=5, cbs=[GradientAccumulation(n_step=2), cb2 := Checkpoint(tmp_path/'ck')])
    with again.no_bar(), again.no_logging(): again.fit(2)
    assert again.gradient_accumulation.steps == 10   # (its logs as the fit ended)
    assert all(torch.equal(a, b) for a,b in zip(w, again.model.parameters())), 'the finished fit was not restored as it ended'
    fresh = make_learner(_data(), 4, seed=5, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck', resume=False)])
    with fresh.no_bar(), fresh.no_logging(): fresh.fit(2)
    assert fresh.gradient_accumulation.steps == 10 and not all(torch.equal(a, b) for a,b in zip(w, fresh.model.parameters()))

def test_bad_arguments_are_named():
    for kw,name in ((dict(every=0), 'every'), (dict(every='-1min'), 'every'), (dict(keep=0), 'keep'), (dict(every='1.5ba'), 'every')):
        with pytest.raises((ValueError, TypeError), match=name): Checkpoint(**kw)

# -- the job: SIGTERM, then --resume -----------------------------------------------------------------------------------
def _job(out, *extra, **kw):
    return subprocess.Popen([sys.executable, '-m', 'accum_callback', '--epochs', '1', '--threads', '1', '--device', 'cpu',
                             '--out', str(out), '--checkpoint-minutes', '0.0005', *extra], cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

def test_the_job_stopped_by_sigterm_resumes_to_the_uninterrupted_results(tmp_path, cache):
    ref = _job(tmp_path/'ref'); _,err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    cut = _job(tmp_path/'cut')
    t0 = time.monotonic()
    while not list((tmp_path/'cut'/'checkpoints').glob('ckpt-*.pt')):   # training has begun: a checkpoint is there
        assert cut.poll() is None and time.monotonic() - t0 < 240, cut.communicate()
        time.sleep(0.05)
    time.sleep(random.Random(1).uniform(0, 1))
    cut.send_signal(signal.SIGTERM)
    _,err = cut.communicate(timeout=120)
    assert cut.returncode == 143 and 'add --resume to continue' in err, err
    assert not (tmp_path/'cut'/'metrics.json').exists()
    again = _job(tmp_path/'cut', '--resume'); _,err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    a,b = (json.loads((tmp_path/d/'metrics.json').read_text()) for d in ('ref', 'cut'))
    assert 'resumed_from' in b and a['accuracy_per_epoch'] == b['accuracy_per_epoch'] and a['valid_loss'] == b['valid_loss']
    assert a['optimizer_steps'] == b['optimizer_steps'] and not (tmp_path/'cut'/'checkpoints').exists()
    from fastai.learner import load_learner
    ma,mb = (load_learner(tmp_path/d/'model.pkl', cpu=True).model.state_dict() for d in ('ref', 'cut'))
    assert all(torch.equal(ma[k], mb[k]) for k in ma), 'the resumed job exported other weights'

def test_the_job_refuses_resume_without_checkpoints(tmp_path):
    p = _job(tmp_path/'none', '--resume'); _,err = p.communicate(timeout=120)
    assert p.returncode == 2 and '--resume: no checkpoint' in err, err

# -- DDP and FSDP2: every rank its own file, its loader's place and its RNGs --------------------------------------------
KINDS = ['ddp', pytest.param('fsdp', marks=pytest.mark.skipif(not __import__('helpers').HAS_FSDP2, reason='no FSDP2'))]

def _ranks(tmp_path, kind, at):
    from accum_callback.testing import launch_gloo
    import resume_worker as RW
    res = launch_gloo(RW.ranks_resume, kwargs=dict(d=str(tmp_path), kind=kind, at=at), timeout=120)
    for r in res:
        assert r['resumed'].endswith(f".rank{r['rank']}.pt"), r
        assert r['model'] and r['opt'] and r['losses'] and r['steps'][0] == r['steps'][1], r

@pytest.mark.parametrize('kind', KINDS)
def test_ranks_resume_bitwise(tmp_path, kind):
    "Both ranks cut at micro-batch 5 (mid-window: under FSDP2 the checkpoint before the window is resumed)"
    _ranks(tmp_path, kind, 5)

@pytest.mark.slow
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('at', [3, 4, 6, 7, 9, 10, 11, 13, 15, 16])   # (from 3: under FSDP2 the first checkpoint is at the first window's end)
def test_ranks_resume_bitwise_at_ten_points(tmp_path, kind, at):
    _ranks(tmp_path, kind, at)

# -- checkpoints that run no code (issue 51) ----------------------------------------------------------------------------
class _Payload:
    "Unpickled, it writes a file: what a planted checkpoint would do with `torch.load(weights_only=False)`"
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (Path.write_text, (Path(self.marker), 'the checkpoint ran code'))

def _plant(path:Path, marker:Path):
    "A file in the package's checkpoint format (magic, CRC-32, length: anyone can compute them) holding `_Payload`"
    import io, struct
    buf = io.BytesIO(); torch.save({'where': 'end', 'x': _Payload(str(marker))}, buf); data = buf.getvalue()
    path.write_bytes(_MAGIC + struct.pack('<IQ', zlib.crc32(data), len(data)) + data)

def test_a_planted_checkpoint_is_refused_and_never_runs(tmp_path):
    from accum_callback.resume.checkpoint import UnsafeCheckpoint
    ck = _interrupted(tmp_path)
    good = sorted(ck.glob('ckpt-*.rank0.pt'))[-1]
    planted,marker = ck/'ckpt-000099.rank0.pt',tmp_path/'ran.txt'
    _plant(planted, marker)
    with pytest.raises(UnsafeCheckpoint, match=r'refused, not read.*Unsupported global'): read_checkpoint(planted)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(ck)])
    with pytest.warns(UserWarning, match=r'ckpt-000099.*refused, not read'), learn.no_logging(): learn.fit(2)
    assert cb.resumed_from == good and not marker.exists()   # the one before it resumed; the payload never ran

@pytest.mark.parametrize('meth', ['fit', 'fit_one_cycle'])
def test_the_packages_checkpoints_load_with_weights_only(tmp_path, meth):
    "Every checkpoint written with every callback of ours and fastai's trackers on reads with `weights_only=True`"
    import io
    from fastai.callback.tracker import EarlyStoppingCallback, SaveModelCallback
    import fastai.callback.schedule   # (fit_one_cycle)
    from accum_callback import GradientNoiseScale
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), GradientNoiseScale(), EarlyStoppingCallback(patience=9),
                                          SaveModelCallback(fname=str(tmp_path/'best')), Checkpoint(tmp_path/'ck', every=('1ep', '3ba'), keep=50)])
    with learn.no_logging(): getattr(learn, meth)(2)
    files = sorted((tmp_path/'ck').glob('ckpt-*.pt'))
    assert len(files) >= 5
    h = len(_MAGIC) + 12
    for f in files:
        torch.load(io.BytesIO(f.read_bytes()[h:]), weights_only=True)   # raises on anything but plain types
        st = read_checkpoint(f)
        assert isinstance(st['rngs'][3][1], __import__('numpy').ndarray)   # numpy's RNG state made again as it was

@pytest.mark.filterwarnings("ignore:The Learner is pickled")   # (said on purpose: tests/test_first_mistakes.py)
def test_a_learner_with_a_checkpoint_exports_copies_and_pickles(tmp_path):
    "fastcore's `Stateful.__setstate__` sets `_state = {}` on an unpickled callback: the checkpoint's own names stay clear"
    import copy, pickle
    from fastai.learner import load_learner
    from fastai.data.core import Datasets
    from fastai.learner import Learner
    from helpers import MLP
    x,y = _data().tensors
    dls = Datasets(list(range(40)), tfms=[[x.__getitem__], [y.__getitem__]], splits=[list(range(32)), list(range(32, 40))]).dataloaders(bs=4)
    learn = Learner(dls, MLP(), loss_func=torch.nn.functional.mse_loss, path=tmp_path,
                    cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck', every=('1ep', '3ba'))])
    with learn.no_logging(): learn.fit(1)
    learn.export('exported.pkl')
    for other in (load_learner(tmp_path/'exported.pkl'), copy.deepcopy(learn), pickle.loads(pickle.dumps(learn))):
        other.dls = learn.dls
        ck = next(c for c in other.cbs if isinstance(c, Checkpoint))
        ck.resume = False
        with other.no_logging(): other.fit(1)
        assert ck.saved, 'the copy wrote no checkpoint'

def test_one_writer_thread_a_fit_ended_with_it_whatever_ends_it(tmp_path):
    """The files are written by one thread a fit (starting one a checkpoint cost the main thread more than a millisecond
    on 2 cores), ended when the fit ends, by its end or an exception; the writer pickled while it runs carries no thread"""
    import pickle, threading
    from fastai.callback.core import Callback
    writers = lambda: {t for t in threading.enumerate() if t.name.startswith('accum_callback-writer')}   # (the objects: an ident is reused)
    seen = []
    class Watch(Callback):
        order = 99   # (after the Checkpoint's save)
        def after_batch(self):
            seen.append(writers())
            if self.iter == 5: assert pickle.loads(pickle.dumps(self.learn.checkpoint._writer)).wait() == (None, None)
    before = writers()
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck', every=('1ep', '1ba')), Watch()])
    with learn.no_logging(): learn.fit(2)
    assert len(cb.saved) >= 20 and len(set.union(*seen) - before) == 1 and writers() == before
    seen.clear()
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck2', every=('1ep', '1ba')), Watch(), RaiseAt(7)])
    with learn.no_logging(), pytest.raises(Boom): learn.fit(2)
    assert len(set.union(*seen) - before) == 1 and writers() == before

# -- resumed as users run it: the progress bar on, epochs skipped through fastai's events (issue 51) ----------------------
def _plain_cbs(ck, **kw):
    from fastai.callback.progress import CSVLogger, ShowGraphCallback
    return [GradientAccumulation(n_step=2), CSVLogger(), ShowGraphCallback(), Checkpoint(ck, **kw)]

@pytest.mark.parametrize('cut', [3, 13, 27])   # in the first, the second and the third epoch (10 batches an epoch)
def test_resumed_past_the_first_epoch_with_the_progress_bar_csvlogger_and_showgraph(tmp_path, cut):
    import matplotlib; matplotlib.use('Agg')
    import fastai.callback.schedule
    ref = make_learner(_data(), 4, cbs=_plain_cbs(tmp_path/'ref_ck'))
    ref.path = tmp_path/'ref'; ref.path.mkdir(); ref.fit_one_cycle(3, 0.05)   # (fastai's default callbacks on: the progress bar)
    learn = make_learner(_data(), 4, cbs=_plain_cbs(tmp_path/'ck', every=('1ep', '2ba')) + [RaiseAt(cut)])
    learn.path = tmp_path/'cut'; learn.path.mkdir()
    with pytest.raises(Boom): learn.fit_one_cycle(3, 0.05)
    again = make_learner(_data(), 4, cbs=_plain_cbs(tmp_path/'ck', every=('1ep', '2ba')))
    again.path = tmp_path/'cut'
    again.fit_one_cycle(3, 0.05)
    assert next(c for c in again.cbs if isinstance(c, Checkpoint)).resumed_from is not None
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
    assert again.recorder.values == ref.recorder.values and again.recorder.iters == ref.recorder.iters
    rows = lambda p: [l.split(',')[:-1] for l in (p/'history.csv').read_text().splitlines()]   # (without the time)
    assert rows(tmp_path/'cut') == rows(tmp_path/'ref') and len(rows(tmp_path/'ref')) == 4   # a header, each epoch once

def test_a_finished_fit_rerun_says_it_trains_nothing_and_other_arguments_are_refused(tmp_path):
    import fastai.callback.schedule
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck')])
    with learn.no_logging(): learn.fit_one_cycle(2, 0.05)
    for kw,named in ((dict(n_epoch=4, lr_max=0.05), r'n_epoch: .* then, .* now'),
                     (dict(n_epoch=2, lr_max=0.01), r"the schedule's lr_max 0\.05 then, 0\.01 now")):
        other = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck')])
        with other.no_logging(), pytest.raises(CheckpointError, match=named): other.fit_one_cycle(**kw)
    same = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ck')])
    with same.no_logging(), pytest.warns(UserWarning, match='finished before .* nothing is trained'): same.fit_one_cycle(2, 0.05)
    assert all(torch.equal(a, b) for a,b in zip(learn.model.parameters(), same.model.parameters()))

def test_another_learning_rate_after_a_kill_is_refused(tmp_path):
    ck = _interrupted(tmp_path)   # fit(2) at the learner's lr 0.1
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(ck)])
    with learn.no_logging(), pytest.raises(CheckpointError, match=r"the fit's lr 0\.1 then, 0\.05 now"):
        learn.fit(2, lr=0.05)

# -- write faults (issue 51) ----------------------------------------------------------------------------------------------
def test_a_path_that_is_a_file_or_unwritable_is_refused_when_the_fit_starts(tmp_path, monkeypatch):
    import accum_callback.core.files as F
    (tmp_path/'afile').write_text('x')
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'afile', every='10min')])
    w = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_logging(), pytest.raises(ValueError, match=r"Checkpoint: `path` .*afile is a file, not a folder"): learn.fit(1)
    assert all(torch.equal(a, b) for a,b in zip(w, learn.model.parameters()))   # nothing trained
    def denied(*a, **k): raise PermissionError(13, 'Permission denied')
    monkeypatch.setattr(F.tempfile, 'mkstemp', denied)   # (the tests run as root, for whom chmod denies nothing)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ro', every='10min')])
    with learn.no_logging(), pytest.raises(ValueError, match=r"cannot write in `path` .*ro \(PermissionError"): learn.fit(1)

def test_a_write_that_fails_mid_fit_warns_and_training_goes_on(tmp_path, monkeypatch):
    import contextlib, errno
    import accum_callback.resume.format as C   # (where checkpoint files are written)
    real,calls = C.atomic_write,[0]
    @contextlib.contextmanager
    def full_disk(path, *a, **k):   # the 2nd and 3rd writes fail part-way, as a full disk (EFBIG, ENOSPC) does
        calls[0] += 1
        with real(path, *a, **k) as f:
            if calls[0] not in (2, 3): yield f; return
            class Part:
                def write(self, b): f.write(b[:7]); raise OSError(errno.EFBIG if calls[0] == 2 else errno.ENOSPC, 'no room')
            yield Part()
    monkeypatch.setattr(C, 'atomic_write', full_disk)
    ref = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2)])
    with ref.no_logging(): ref.fit(2)
    learn = make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2), cb := Checkpoint(tmp_path/'ck', every=('1ep', '3ba'), keep=20)])
    with learn.no_logging(), pytest.warns(UserWarning, match=r'could not write .*ckpt-000002.* \(OSError: .*no room\); training goes on, the last good checkpoint is .*ckpt-000001'):
        learn.fit(2)
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), learn.model.parameters()))   # the fit went on, unchanged
    names = sorted(f.name for f in (tmp_path/'ck').iterdir())
    assert 'ckpt-000002.rank0.pt' not in names and 'ckpt-000003.rank0.pt' not in names and 'ckpt-000004.rank0.pt' in names
    assert not [n for n in names if n.endswith('.part')] and cb.saved[0] == 1 and 2 not in cb.saved   # nothing half-written
    for f in (tmp_path/'ck').glob('ckpt-*.pt'): read_checkpoint(f)   # every file there reads whole

# -- Checkpoint alone, on a plain Learner (issue 51) -----------------------------------------------------------------------
@pytest.mark.parametrize('cut', [5, 17])   # mid-epoch, in the first and the second epoch
def test_checkpoint_alone_resumes_mid_epoch_bitwise(tmp_path, cut):
    import fastai.callback.schedule
    from fastai.torch_core import set_seed
    set_seed(0)   # (a shuffled fastai loader seeds its order from the global `random` when it is made)
    ref = make_learner(_data(), 4, cbs=[Checkpoint(tmp_path/'ref')], shuffle=True)
    ref.fit_one_cycle(2, 0.05)
    set_seed(0); learn = make_learner(_data(), 4, cbs=[cb := Checkpoint(tmp_path/'ck', every=('1ep', '3ba')), RaiseAt(cut)], shuffle=True)
    with pytest.raises(Boom): learn.fit_one_cycle(2, 0.05)
    newest = sorted((tmp_path/'ck').glob('ckpt-*.pt'))[-1]
    assert read_checkpoint(newest)['where'] == 'mid'
    set_seed(0); again = make_learner(_data(), 4, cbs=[cb2 := Checkpoint(tmp_path/'ck', every=('1ep', '3ba'))], shuffle=True)
    again.fit_one_cycle(2, 0.05)
    assert cb2.resumed_from == newest
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
    assert again.recorder.values == ref.recorder.values and again.recorder.losses == ref.recorder.losses

def test_checkpoint_alone_every_optimizer_step(tmp_path):
    "Without GradientAccumulation, `every` counts fastai's own optimizer steps (it counted none: epoch ends only)"
    learn = make_learner(_data(), 4, cbs=[cb := Checkpoint(tmp_path/'ck', every='3st', keep=50)])
    with learn.no_logging(): learn.fit(1)   # 10 steps: a checkpoint after steps 3, 6, 9, and the one at the fit's end
    assert [read_checkpoint(f)['opt_steps'] for f in sorted((tmp_path/'ck').glob('ckpt-*.pt'))] == [3, 6, 9, 10]

# -- random transforms, worker processes, language models (issue 51) ------------------------------------------------------
_X,_Y = _data().tensors
def _item_x(i): return _X[i] + random.random() + float(__import__('numpy').random.rand()) + torch.rand(1)   # three RNGs
def _item_y(i): return _Y[i]
def _noisy(t): return t + random.gauss(0, 0.1) + torch.randn_like(t)*0.01   # a batch transform (main process)

def _rand_add():
    "fastai's RandTransform: whether it applies (`do`) and by how much are drawn from Python's `random`"
    from fastai.vision.augment import RandTransform
    class RandAdd(RandTransform):
        split_idx,order = 0,50
        def before_call(self, b, split_idx): super().before_call(b, split_idx); self.v = random.random()
        def encodes(self, x:torch.Tensor): return x + self.v if x.is_floating_point() else x
    return RandAdd

def _random_learner(cbs, workers:int):
    from fastai.data.core import Datasets
    from fastai.learner import Learner
    from fastai.torch_core import set_seed
    from helpers import MLP
    set_seed(0)
    RandAdd = _rand_add()
    dls = Datasets(list(range(40)), tfms=[[_item_x, RandAdd(0.5)], [_item_y]], splits=[list(range(32)), list(range(32, 40))]
                   ).dataloaders(bs=4, shuffle=True, num_workers=workers, after_batch=[_noisy, RandAdd(0.7)])
    return Learner(dls, MLP(), loss_func=torch.nn.functional.mse_loss, cbs=cbs)

def _cut_and_resumed(make, fit, tmp_path, cut:int, every, quiet:bool=True):
    """A Learner `make(cbs)` fitted by `fit(learn)` (`quiet`: without fastai's logging; a `Boom` swallowed) uninterrupted,
    then cut at loader batch `cut` with checkpoints as `every` says, then again: it resumed, to the uninterrupted weights
    bitwise. `(ref, resumed)`"""
    def run(cbs):
        learn = make(cbs)
        with (learn.no_logging() if quiet else contextlib.nullcontext()):
            try: fit(learn)
            except Boom: pass
        return learn
    ref = run([Checkpoint(tmp_path/'ref')])
    run([Checkpoint(tmp_path/'ck', every=every), RaiseAt(cut)])
    again = run([cb := Checkpoint(tmp_path/'ck', every=every)])
    assert cb.resumed_from is not None
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
    return ref,again

@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('ga', [True, False], ids=['accumulate', 'plain'])
@pytest.mark.parametrize('cut', [6, 17])   # mid-epoch in the first and the second of 3 epochs (8 batches each)
def test_random_transforms_resume_bitwise(tmp_path, workers, ga, cut):
    "Item and batch transforms drawing from `random`, numpy and torch, with worker processes too: the same batches"
    import fastai.callback.schedule
    acc = [GradientAccumulation] if ga else []
    ref,again = _cut_and_resumed(lambda cbs: _random_learner([c(n_step=2) for c in acc] + cbs, workers),
                                 lambda learn: learn.fit_one_cycle(3, 0.05), tmp_path, cut, every='3ba')
    assert again.recorder.losses == ref.recorder.losses

def _tfmd_dl_learner(cbs, workers:int):
    """A `TfmdDL` made directly (its `n_inp` computed lazily, by one pass of its transforms at the first batch), a fastai
    `RandTransform` item transform and a batch transform drawing from `random`, a model with dropout"""
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.learner import Learner
    from fastai.torch_core import set_seed
    from fastai.vision.augment import RandTransform
    from helpers import MLP
    class Flip(RandTransform):
        split_idx,order = 0,60
        def encodes(self, x:torch.Tensor): return -x if x.is_floating_point() else x
    set_seed(0)
    g = lambda i: torch.Generator().manual_seed(i)
    ds = [(torch.randn(5, generator=g(i)), torch.randn(3, generator=g(100+i))) for i in range(56)]
    dls = DataLoaders(TfmdDL(ds[:48], bs=8, shuffle=True, num_workers=workers, after_item=[Flip(p=0.5)],
                             after_batch=[lambda t: t*(1 + random.random()*0.1)]), TfmdDL(ds[48:], bs=8))
    return Learner(dls, torch.nn.Sequential(MLP(), torch.nn.Dropout(0.1)), loss_func=torch.nn.functional.mse_loss, cbs=cbs)

@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('cut', [5, 11])   # mid-epoch in the first and the second of 3 epochs (6 batches each)
def test_random_transforms_beside_dropout_resume_bitwise(tmp_path, workers, cut):
    """Issue 61, item 7: fastai's `TfmdDL` draws from `random` once, lazily, the first time its `n_inp` is read: the
    uninterrupted run did at its first batch, the resumed one did after its RNGs were put back (every later draw shifted,
    weights 0.02-0.04 apart). The same batches and weights, bitwise"""
    ref,again = _cut_and_resumed(lambda cbs: _tfmd_dl_learner([GradientAccumulation(n_step=2)] + cbs, workers),
                                 lambda learn: learn.fit(3, 0.05), tmp_path, cut, every=('1ep', '1ba'))
    assert again.recorder.losses == ref.recorder.losses

@pytest.mark.parametrize('cut,micro_bs', [(7, None), (95, None), (7, 3), (6, 1)])   # in the first and the second epoch (80 batches each)
def test_language_model_resumes_bitwise(tmp_path, cut, micro_bs):
    """AWD_LSTM's hidden state carried from batch to batch, and LMDataLoader's shuffle from the global `random`; with
    `micro_bs` (loader batches of 4 cut in pieces) the checkpoint holds the whole batch's rows of the hidden state, not
    its last piece's (issue 61, item 8: 2.4e-2 off)"""
    import apps
    from fastai.text.all import AWD_LSTM, ColReader, ColSplitter, DataBlock, awd_lstm_lm_config, language_model_learner
    from fastai.torch_core import set_seed
    def make(cbs):
        set_seed(0)
        dls = DataBlock(blocks=apps._text_block(is_lm=True), get_x=ColReader('text'), splitter=ColSplitter()
                        ).dataloaders(apps._texts(60, 0), bs=4, seq_len=6, shuffle=True, device='cpu', num_workers=0)
        torch.manual_seed(0)
        return language_model_learner(dls, AWD_LSTM, pretrained=False, config=dict(awd_lstm_lm_config, **apps.AWD),
                                      drop_mult=0.5, lr=0.05, cbs=[*accumulation(n_step=2, micro_bs=micro_bs)] + cbs)
    _cut_and_resumed(make, lambda learn: learn.fit(2), tmp_path, cut, every=('1ep', '1ba'))

# -- state as a protocol (issue 51) ------------------------------------------------------------------------------------------
class _Counting:
    "A user's callback with state: the training batches it has seen (and their losses), kept by `state_dict()`"
    def __new__(cls, bad=False):
        from fastai.callback.core import Callback
        class Counting(Callback):
            order = 70
            def __init__(self): self.n,self.total = 0,torch.zeros(())
            def after_batch(self):
                if self.training: self.n += 1; self.total = self.total + self.learn.loss.detach()
            def state_dict(self): return dict(n=self.n, total=self.total, **({'what': object()} if bad else {}))
            def load_state_dict(self, sd): self.n,self.total = sd['n'],sd['total']
        return Counting()

def test_a_users_callback_state_is_saved_and_restored_by_its_protocol(tmp_path):
    ref = make_learner(_data(), 4, cbs=[c0 := _Counting()])
    with ref.no_logging(): ref.fit(2)
    learn = make_learner(_data(), 4, cbs=[_Counting(), Checkpoint(tmp_path/'ck', every=('1ep', '3ba')), RaiseAt(13)])
    with learn.no_logging(), pytest.raises(Boom): learn.fit(2)
    again = make_learner(_data(), 4, cbs=[c := _Counting(), Checkpoint(tmp_path/'ck', every=('1ep', '3ba'))])
    with again.no_logging(): again.fit(2)
    assert (c.n, float(c.total)) == (c0.n, float(c0.total)) == (20, float(c0.total))
    bad = make_learner(_data(), 4, cbs=[_Counting(bad=True), Checkpoint(tmp_path/'bad', every=('1ep', '3ba'))])
    w = [p.detach().clone() for p in bad.model.parameters()]
    with bad.no_logging(), pytest.raises(CheckpointError, match=r"\['callbacks'\]\['counting'\]\['what'\] holds a builtins.object"):
        bad.fit(1)   # refused when the fit starts: nothing trained
    assert all(torch.equal(a, b) for a,b in zip(w, bad.model.parameters()))

# -- the job at its default 3 epochs, killed in each (issue 51) --------------------------------------------------------------
@pytest.fixture(scope='module')
def job_ref(tmp_path_factory, cache_dir):
    "The uninterrupted job at 3 epochs (its metrics and exported weights), once for the module"
    import os
    from unittest import mock
    out = tmp_path_factory.mktemp('job3')/'ref'
    with mock.patch.dict(os.environ, {'ACCUM_CALLBACK_CACHE': str(cache_dir)}):
        p = _job(out, '--epochs', '3'); _,err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return out

def _newest_epoch(folder:Path):
    for f in sorted(folder.glob('ckpt-*.pt'), reverse=True):
        try: return read_checkpoint(f)['epoch']
        except (OSError, CheckpointError): continue   # (removed or being replaced while read)
    return None

def _killed_in_epoch(tmp_path, epoch:int, sig):
    "The job at 3 epochs, killed by `sig` once its checkpoints are in epoch `epoch` (from 0), then resumed"
    out = tmp_path/'cut'
    cut = _job(out, '--epochs', '3')
    t0 = time.monotonic()
    while (_newest_epoch(out/'checkpoints') or -1) < epoch:
        assert cut.poll() is None and time.monotonic() - t0 < 300, cut.communicate()
        time.sleep(0.02)
    cut.send_signal(sig)
    _,err = cut.communicate(timeout=120)
    assert cut.returncode == (143 if sig == signal.SIGTERM else -9), err
    again = _job(out, '--epochs', '3', '--resume'); _,err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    return out

def _same_job(ref:Path, out:Path):
    a,b = (json.loads((d/'metrics.json').read_text()) for d in (ref, out))
    assert 'resumed_from' in b and a['accuracy_per_epoch'] == b['accuracy_per_epoch'] and a['valid_loss'] == b['valid_loss']
    assert a['optimizer_steps'] == b['optimizer_steps']
    from fastai.learner import load_learner
    ma,mb = (load_learner(d/'model.pkl', cpu=True).model.state_dict() for d in (ref, out))
    assert all(torch.equal(ma[k], mb[k]) for k in ma), 'the resumed job exported other weights'

@pytest.mark.parametrize('epoch,sig', [(1, signal.SIGKILL), (2, signal.SIGTERM)], ids=['kill-epoch2', 'term-epoch3'])
def test_the_job_at_three_epochs_resumes_past_the_first(tmp_path, job_ref, cache, epoch, sig):
    _same_job(job_ref, _killed_in_epoch(tmp_path, epoch, sig))

@pytest.mark.slow
@pytest.mark.parametrize('epoch', [0, 1, 2])
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['kill', 'term'])
def test_the_job_at_three_epochs_killed_in_each_epoch(tmp_path, job_ref, cache, epoch, sig):
    _same_job(job_ref, _killed_in_epoch(tmp_path, epoch, sig))

# -- with fastai's own callbacks as users combine them ----------------------------------------------------------------------
@pytest.mark.parametrize('extra', ['ReduceLROnPlateau', 'ShortEpochCallback', 'BnFreeze'])
def test_resumed_with_fastais_callbacks(tmp_path, extra):
    """A run cut mid-epoch in the second epoch and resumed, with 'pool', a shuffled loader, the progress bar, and one of
    fastai's callbacks that act on epochs: the uninterrupted weights and buffers bitwise. Before: ReduceLROnPlateau saw
    the skipped epochs' rows again and cut the learning rate twice; ShortEpochCallback read `learn.iter` from 0 in the
    resumed epoch and trained past its fraction"""
    import torch.nn as nn
    from fastai.callback.training import BnFreeze, ShortEpochCallback
    from fastai.callback.tracker import ReduceLROnPlateau
    from fastai.torch_core import set_seed
    from accum_callback import BatchNormAccumulation
    make = dict(ReduceLROnPlateau=lambda: ReduceLROnPlateau(patience=0), ShortEpochCallback=lambda: ShortEpochCallback(0.7),
                BnFreeze=lambda: BnFreeze())[extra]
    def learner(cbs):
        set_seed(0); torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        return make_learner(_data(), 4, model=model, shuffle=True,
                            cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool'), make()] + cbs)
    ref,again = _cut_and_resumed(learner, lambda learn: learn.fit(3, 0.05), tmp_path, 11, every=('1ep', '2ba'), quiet=False)
    assert all(torch.equal(a, b) for a,b in zip(ref.model.state_dict().values(), again.model.state_dict().values()))
    assert again.opt.hypers[0]['lr'] == ref.opt.hypers[0]['lr']
