"""`resume.cadence`: `Checkpoint`'s one `every` (`'<n>ep'`, `'<n>ba'`, `'<n>min'`, `'<n>st'`/`'<n>step'`, an int, a
tuple of these, None), its refusals in one line naming `every`, the keywords before 0.3 refused naming their new
spelling, and each unit firing where it says: the places of the checkpoints a fit of 2 epochs leaves (40 samples in
loader batches of 4: 10 a epoch; windows of 2: 5 optimizer steps a epoch)."""
import types

import pytest
import torch
from fastai.callback.core import Callback
from torch.utils.data import TensorDataset

from accum_callback import Checkpoint, GradientAccumulation
from accum_callback.resume import cadence
from accum_callback.resume.cadence import Cadence
from accum_callback.resume.checkpoint import read_checkpoint
from helpers import make_data, make_learner

@pytest.mark.parametrize('every,fields', [
    ('1ep', dict(epochs=1)), ('2ep', dict(epochs=2)), ('3ba', dict(batches=3)), (' 3 BA ', dict(batches=3)),
    ('30min', dict(minutes=30.)), ('0.5min', dict(minutes=.5)), ('5e-05min', dict(minutes=5e-05)),
    ('100st', dict(steps=100)), ('4step', dict(steps=4)), ('step', dict(steps=1)), (7, dict(steps=7)),
    (('1ep', '30min'), dict(epochs=1, minutes=30.)), (['2ba', 3], dict(batches=2, steps=3)), (None, {}), ((), {})])
def test_every_is_read(every, fields):
    c = Cadence(every)
    assert {k: getattr(c, k) for k in ('epochs', 'batches', 'minutes', 'steps')} == dict(dict.fromkeys(('epochs', 'batches', 'minutes', 'steps')), **fields)
    assert Checkpoint(every=every).every == every

@pytest.mark.parametrize('every', [0, -1, True, 1.5, '0ep', '1.5ep', '2.5ba', 'ep', 'ba', 'min', '0min', '-1min', 'infmin',
                                   '1e999min', 'nanmin', 'e5min', '3', '3 days', '3epochs', '', ('1ep', '2ep'), (3, '1st'),
                                   (('1ep',),), {'1ep'}, b'1ep'])
def test_a_bad_every_is_refused_in_one_line_with_the_forms(every):
    with pytest.raises(ValueError, match=r"^`every` must be an int n \(optimizer steps\), '<n>ep' .*'<n>ba' .*'<n>min'") as e:
        Checkpoint(every=every)
    assert '\n' not in str(e.value) and repr(every) in str(e.value)

@pytest.mark.parametrize('kw,says', [(dict(minutes=30), "`minutes=30` is `every='30min'` since 0.3"),
                                     (dict(batches=3), "`batches=3` is `every='3ba'` since 0.3"),
                                     (dict(epoch_end=True), "`epoch_end=True` is `every='1ep'` since 0.3"),
                                     (dict(epoch_end=False), "`epoch_end=False` is an `every` without '1ep' since 0.3"),
                                     (dict(every=2, minutes=0.5), "`minutes=0.5` is `every='0.5min'` since 0.3")])
def test_the_keywords_before_0_3_name_their_spelling_in_every(kw, says):
    with pytest.raises(TypeError, match='^Checkpoint: ' + says.replace('(', r'\(').replace(')', r'\)')): Checkpoint(**kw)
    with pytest.raises(TypeError, match='unexpected keyword argument'): Checkpoint(every_steps=3)

class _Clock(Callback):
    "A clock 25 s on at each training micro-batch's end, before `Checkpoint` reads it (the cadence's own clock, replaced)"
    order = Checkpoint.order - 1
    def __init__(self): self.t = 0.
    def after_batch(self):
        if self.training: self.t += 25.

def _places(tmp_path, every, n_epoch=2, clock=None):
    "The checkpoints a fit of `n_epoch` leaves with `every`: `(where, epoch, loader batches done, optimizer steps)` each"
    x,y = make_data(40, seed=4).tensors
    learn = make_learner(TensorDataset(x, y), 4, cbs=[GradientAccumulation(n_step=2), Checkpoint(tmp_path, every=every, keep=100), *([clock] if clock else [])])
    with learn.no_bar(), learn.no_logging(): learn.fit(n_epoch)
    return [(st['where'], st['epoch'], st['k'], st['opt_steps']) for st in map(read_checkpoint, sorted(tmp_path.glob('ckpt-*.pt')))]

@pytest.mark.parametrize('every,places', [
    ('1ep', [('end', 0, 10, 5), ('end', 1, 10, 10), ('done', 1, 10, 10)]),
    ('2ep', [('end', 1, 10, 10), ('done', 1, 10, 10)]),
    ('3ba', [('mid', 0, 3, 1), ('mid', 0, 6, 3), ('mid', 0, 9, 4), ('mid', 1, 3, 6), ('mid', 1, 6, 8), ('mid', 1, 9, 9),
             ('done', 1, 10, 10)]),   # mid-window at 3 and 9 (windows of 2); the epoch's last batch is its end's
    ('5ba', [('mid', 0, 5, 2), ('end', 0, 10, 5), ('mid', 1, 5, 7), ('end', 1, 10, 10), ('done', 1, 10, 10)]),   # (10: at the end)
    ('2st', [('mid', 0, 4, 2), ('mid', 0, 8, 4), ('mid', 1, 2, 6), ('mid', 1, 6, 8), ('end', 1, 10, 10), ('done', 1, 10, 10)]),
    (3, [('mid', 0, 6, 3), ('mid', 1, 2, 6), ('mid', 1, 8, 9), ('done', 1, 10, 10)]),
    ('step', [('mid', 0, 2*i, i) for i in range(1, 5)] + [('end', 0, 10, 5)] + [('mid', 1, 2*i, 5+i) for i in range(1, 5)] +
             [('end', 1, 10, 10), ('done', 1, 10, 10)]),
    (('1ep', '4ba'), [('mid', 0, 4, 2), ('mid', 0, 8, 4), ('end', 0, 10, 5), ('mid', 1, 4, 7), ('mid', 1, 8, 9),
                      ('end', 1, 10, 10), ('done', 1, 10, 10)]),
    (None, [('done', 1, 10, 10)])])
def test_each_unit_fires_where_it_says(tmp_path, every, places):
    assert _places(tmp_path, every) == places

def test_minutes_fire_at_micro_batches_ends_counted_from_the_last_checkpoint(tmp_path, monkeypatch):
    "'1min' on a clock of 25 s a micro-batch: at batches 3, 6, 9 (75 s each), not at the epoch's end (25 s after)"
    clock = _Clock()
    monkeypatch.setattr(cadence, 'time', types.SimpleNamespace(monotonic=lambda: clock.t))
    assert _places(tmp_path, '1min', n_epoch=1, clock=clock) == [('mid', 0, 3, 1), ('mid', 0, 6, 3), ('mid', 0, 9, 4), ('done', 0, 10, 5)]
    assert _places(tmp_path/'b', ('1ep', '1min'), n_epoch=1, clock=clock) == [('mid', 0, 3, 1), ('mid', 0, 6, 3), ('mid', 0, 9, 4),
                                                                               ('end', 0, 10, 5), ('done', 0, 10, 5)]

def test_a_resume_after_3ba_mid_window_is_bitwise(tmp_path):
    "Cut at the 8th loader batch of the second epoch with `every='3ba'`: resumed from its 6th (the window after it half done)"
    class Cut(Callback):
        order = Checkpoint.order + 1
        def __init__(self): self.k = 0
        def after_batch(self):
            if self.training:
                self.k += 1
                if self.k == 18: raise RuntimeError('cut')
    x,y = make_data(40, seed=4).tensors
    mk = lambda *cbs: make_learner(TensorDataset(x, y), 4, cbs=[GradientAccumulation(n_step=4), *cbs])
    ref = mk()
    with ref.no_bar(), ref.no_logging(): ref.fit(2)
    cut = mk(Checkpoint(tmp_path, every='3ba'), Cut())
    with cut.no_bar(), cut.no_logging(), pytest.raises(RuntimeError, match='cut'): cut.fit(2)
    newest = sorted(tmp_path.glob('ckpt-*.pt'))[-1]
    st = read_checkpoint(newest)
    assert (st['where'], st['epoch'], st['k']) == ('mid', 1, 6)
    again = mk(cb := Checkpoint(tmp_path, every='3ba'))
    with again.no_bar(), again.no_logging(): again.fit(2)
    assert cb.resumed_from == newest
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
