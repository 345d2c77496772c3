"""A fit that ends by any exception at any event (a notebook's stop button: `KeyboardInterrupt`; another callback's
error) leaves the model and the Learner as before the fit: BatchNorm's modes, momenta and hooks, the Learner's
callbacks and loaders, a model that pickles; a new Learner on the same model trains as on a clean copy (issue 51)."""
import copy, pickle
import pytest
import torch, torch.nn as nn
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.learner import Learner

from accum_callback import BatchNormAccumulation, Checkpoint, GradientAccumulation, GradientNoiseScale, MicroBatching
from helpers import accumulation, make_dls

EVENTS = ('before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss', 'before_backward',
          'after_backward', 'before_step', 'after_step', 'after_batch', 'after_train', 'before_validate', 'after_validate',
          'after_epoch', 'after_fit')

class Stop(Callback):
    "Raises `exc` at the first `event` it sees (order 99: after every callback of ours, as fastai's own come)"
    order = 99
    def __init__(self, event, exc): self.event,self.exc,self.done = event,exc,False
    def __call__(self, event_name):
        if event_name == self.event and not self.done and getattr(self.learn, 'lock', None) is not None and not self.learn.lock.locked():
            self.done = True; raise self.exc
        return super().__call__(event_name)

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4*6*6, 3))

def _data(n=32):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))

CONFIGS = {
    'pool': lambda: [GradientAccumulation(n_step=2), BatchNormAccumulation('pool')],
    'momentum': lambda: [GradientAccumulation(n_step=2), BatchNormAccumulation('momentum')],
    'freeze': lambda: [GradientAccumulation(n_step=2), BatchNormAccumulation('freeze')],
    'auto': lambda: [GradientAccumulation(n_step=2), MicroBatching('auto')],
    'noise': lambda: [GradientAccumulation(n_step=2), GradientNoiseScale()],
    'checkpoint': lambda: [GradientAccumulation(n_step=2), Checkpoint('ck', every=('1ep', '2ba'))],
}

def _snapshot(learn):
    m = learn.model
    bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
    return dict(momenta=[b.momentum for b in bns], requires_grad=[p.requires_grad for p in m.parameters()],
                hooks=[(len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks)) for x in m.modules()],
                cbs=[type(c).__name__ for c in learn.cbs], metrics=list(learn.metrics), patched=sorted(k for k in
                ('_with_events', '_do_epoch', 'one_batch', 'dl', 'get_preds') if k in learn.__dict__ and k != 'dl' or
                (k == 'dl' and type(learn.__dict__.get('dl')).__module__.startswith('accum_callback'))))

# before_fit: fastai runs it before the first epoch, outside everything a callback can wrap from its own `before_fit`
# (the fit-level `_with_events` is looked up before it): an exception from a callback ordered after ours, in that
# event, leaves what ours set up there. Shown, not hidden: the limit docs/resume.md states
_BEFORE_FIT = pytest.mark.xfail(strict=True, reason="an exception in a later callback's before_fit: the stated limit")
@pytest.mark.parametrize('event', [pytest.param(e, marks=_BEFORE_FIT) if e == 'before_fit' else e for e in EVENTS])
@pytest.mark.parametrize('config', list(CONFIGS))
@pytest.mark.parametrize('exc', [KeyboardInterrupt, RuntimeError], ids=['interrupt', 'error'])
def test_an_exception_at_any_event_leaves_everything_as_before(tmp_path, config, event, exc):
    learn = Learner(make_dls(_data(), 4), _model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=CONFIGS[config]())
    before = _snapshot(learn)
    learn.add_cb(Stop(event, exc('stopped here')))
    with learn.no_logging(), pytest.raises(exc, match='stopped here'): learn.fit(1)
    learn.remove_cb(learn.cbs[-1])   # (the Stop callback)
    after = _snapshot(learn)
    assert after == before
    pickle.dumps(learn.model); copy.deepcopy(learn.model)
    # a new Learner on the same model trains as on a clean copy of it
    clean = _model(); clean.load_state_dict(learn.model.state_dict())
    a = Learner(make_dls(_data(), 4), learn.model, loss_func=nn.CrossEntropyLoss(), path=tmp_path/'a')
    b = Learner(make_dls(_data(), 4), clean, loss_func=nn.CrossEntropyLoss(), path=tmp_path/'b')
    for l in (a, b):
        torch.manual_seed(3)
        with l.no_logging(): l.fit(1)
    assert all(torch.equal(x, y) for x,y in zip(a.model.state_dict().values(), b.model.state_dict().values()))

@pytest.mark.parametrize('ga', [dict(n_step=2), dict(n_step=2, micro_bs=2)])
def test_summary_lr_find_and_show_results_with_every_callback_on(tmp_path, ga):
    """`micro_bs`: its `MicroBatching` left the Learner for good in `summary()` (its `GradientAccumulation` was taken off
    for the pass, which made it an orphan)"""
    import fastai.callback.schedule, fastai.callback.hook   # (lr_find, summary)
    cbs = [*accumulation(**ga), BatchNormAccumulation('pool'), GradientNoiseScale(), Checkpoint('ck', every=('1ep', '2ba'))]
    learn = Learner(make_dls(_data(), 4), _model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=cbs)
    before = _snapshot(learn)
    learn.summary()   # (fastai's summary takes the `_only_train_loop` callbacks off and adds them back at the end)
    sort = lambda d: {**d, 'cbs': sorted(d['cbs'])}
    assert sort(_snapshot(learn)) == sort(before), 'summary() left callbacks or the model changed'
    before = _snapshot(learn)
    with learn.no_logging(): learn.lr_find(num_it=5, show_plot=False)
    assert _snapshot(learn) == before and not list((tmp_path/'ck').glob('*.pt'))   # lr_find is no fit to checkpoint
    seen = []   # (the fit after them still cuts its loader batches of 4 into micro-batches of 2)
    h = learn.model.register_forward_pre_hook(lambda m, a: seen.append(len(a[0])) if m.training else None)
    with learn.no_logging(): learn.fit(1)
    h.remove(); assert set(seen) == ({2} if 'micro_bs' in ga else {4})
    learn.get_preds(); assert _snapshot(learn) == before

# -- the stop button of a live Jupyter kernel -----------------------------------------------------------------------------------
_KERNEL_SETUP = '''
import sys, json, time, torch, torch.nn as nn
sys.path[:0] = [{tests!r}]
from fastai.callback.core import Callback
from fastai.learner import Learner
from accum_callback import BatchNormAccumulation, GradientAccumulation, GradientNoiseScale
from helpers import make_dls
from test_interrupt import _data, _model, _snapshot
class SlowEpochEnd(Callback):   # a callback busy at after_epoch (a metric, a plot, a save), where the button is pressed
    order = 99
    def after_epoch(self):
        open({ready!r}, 'w').write('ready'); time.sleep(120)
learn = Learner(make_dls(_data(), 4), _model(), loss_func=nn.CrossEntropyLoss(), path={path!r},
                cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool'), GradientNoiseScale(), SlowEpochEnd()])
before = _snapshot(learn)
'''

def test_the_stop_button_of_a_live_kernel_at_after_epoch(tmp_path):
    "A notebook's stop button (the kernel's interrupt, SIGINT) while a callback runs at after_epoch: everything as before"
    import time
    jupyter_client = pytest.importorskip('jupyter_client')
    from pathlib import Path
    ready = tmp_path/'ready'
    km,kc = jupyter_client.manager.start_new_kernel(kernel_name='python3', cwd=str(tmp_path))
    try:
        def run(code, timeout=120):
            out = []
            def hook(msg):
                if msg['msg_type'] == 'stream': out.append(msg['content']['text'])
                elif msg['msg_type'] == 'error': out.append(msg['content']['ename'])
            reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
            return reply['content']['status'],''.join(out)
        status,out = run(_KERNEL_SETUP.format(tests=str(Path(__file__).parent), ready=str(ready), path=str(tmp_path)))
        assert status == 'ok', out
        kc.execute('learn.fit(2)')
        t0 = time.monotonic()
        while not ready.exists():
            assert time.monotonic() - t0 < 120, 'the fit did not reach after_epoch'
            time.sleep(0.05)
        km.interrupt_kernel()
        t0 = time.monotonic()
        while True:   # the fit's cell ends with KeyboardInterrupt
            msg = kc.get_shell_msg(timeout=60)
            if msg['msg_type'] == 'execute_reply': break
        assert msg['content']['status'] == 'error' and msg['content']['ename'] == 'KeyboardInterrupt', msg['content']
        # ipykernel aborts requests that reach it just after a cell's error: one aborted never ran, so it is sent again
        code = ("import pickle; pickle.dumps(learn.model); "
                         "print(json.dumps(dict(same=_snapshot(learn) == before, patched=sorted(learn.__dict__.keys() & "
                         "{'_with_events', '_do_epoch'}), momenta=[b.momentum for b in learn.model.modules() if isinstance(b, nn.BatchNorm2d)])))")
        status,out = run(code)
        if status == 'aborted': time.sleep(1); status,out = run(code)
        assert status == 'ok', out
        res = __import__('json').loads(out.strip().splitlines()[-1])
        assert res == dict(same=True, patched=[], momenta=[0.1]), res
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)

def test_a_refused_resume_leaves_everything_as_before(tmp_path):
    "Checkpoint refuses a resume in before_fit, after 'pool' and micro_bs='auto' have set up: they are put back"
    from accum_callback.resume.checkpoint import CheckpointError
    class Boom(Callback):
        order = 99
        def after_batch(self):
            if self.training and self.iter == 3: raise RuntimeError('cut')
    learn = Learner(make_dls(_data(), 4), _model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path,
                    cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool'), Checkpoint('ck', every=('1ep', '1ba')), Boom()])
    with learn.no_logging(), pytest.raises(RuntimeError, match='cut'): learn.fit(1)
    again = Learner(make_dls(_data(), 4), _model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path,
                    cbs=[GradientAccumulation(n_step=4), MicroBatching('auto'), BatchNormAccumulation('pool'), Checkpoint('ck')])
    before = _snapshot(again)
    with again.no_logging(), pytest.raises(CheckpointError, match='window'): again.fit(1)
    assert _snapshot(again) == before
    pickle.dumps(again.model)
