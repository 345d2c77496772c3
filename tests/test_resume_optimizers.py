"""(Modules `resume.fit_state`, `resume.checkpoint`.) Any optimizer resumes: fastai's own and torch's behind fastai's
`OptimWrapper` (`opt_func=partial(OptimWrapper, opt=torch.optim.AdamW)`, fastai's documented way) through their
`state_dict` protocol, the saved state checked whole before anything is applied. A fit cut mid-epoch and run again
ends bitwise where the uninterrupted fit ends (weights and optimizer state); a state it cannot apply is passed over
with one warning, naming it."""
import warnings
from functools import partial

import pytest
import torch
from fastai.optimizer import OptimWrapper, Adam, SGD

from accum_callback import Checkpoint, GradientAccumulation
from helpers import make_learner
from test_resume import Boom, RaiseAt, _data

OPTS = {'fastai-Adam': Adam, 'fastai-SGD-mom': partial(SGD, mom=0.9),
        'torch-SGD': partial(OptimWrapper, opt=partial(torch.optim.SGD, momentum=0.9)),
        'torch-Adam': partial(OptimWrapper, opt=torch.optim.Adam),
        'torch-AdamW': partial(OptimWrapper, opt=torch.optim.AdamW),
        'torch-RMSprop': partial(OptimWrapper, opt=torch.optim.RMSprop)}

def _fit(learn, meth):
    with learn.no_logging():
        try:
            if meth == 'fit': learn.fit(2)
            elif meth == 'fit_one_cycle': learn.fit_one_cycle(2, 1e-2)
            else: learn.fit(1); learn.fit(1)   # a sequence of fits in one session
        except Boom: pass
    return learn

def _opt_tensors(learn)->list:
    "Every tensor of the optimizer's state, by its protocol"
    sd = learn.opt.state_dict()['state']
    return [v for d in (sd.values() if isinstance(sd, dict) else sd) for v in d.values() if isinstance(v, torch.Tensor)]

def _cut_and_resumed(tmp_path, opt_func, meth='fit', cut=7, ga=None):
    """The fit uninterrupted, cut at training batch `cut` with checkpoints every 3, and run again: (the uninterrupted
    Learner, the resumed one, its Checkpoint, what it warned but that an earlier fit of the sequence finished)"""
    import fastai.callback.schedule   # (fit_one_cycle)
    mk = lambda cbs: make_learner(_data(), 4, cbs=[GradientAccumulation(**(ga or dict(n_step=2)))] + cbs,
                                  opt_func=opt_func, lr=1e-2)
    ref = _fit(mk([]), meth)
    _fit(mk([Checkpoint(tmp_path/'ck', every=('1ep', '3ba')), RaiseAt(cut)]), meth)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        again = _fit(mk([cb := Checkpoint(tmp_path/'ck', every=('1ep', '3ba'))]), meth)
    said = [str(w.message) for w in said]
    return ref,again,cb,[m for m in said if 'Checkpoint' in m and 'finished before' not in m]

@pytest.mark.parametrize('name', list(OPTS))
def test_every_optimizer_resumes_bitwise(tmp_path, name):
    ref,again,cb,said = _cut_and_resumed(tmp_path, OPTS[name])
    assert cb.resumed_from is not None and not said, said
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
    a,b = _opt_tensors(ref),_opt_tensors(again)
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x,y in zip(a, b))

@pytest.mark.parametrize('meth,cut,ga', [('fit_one_cycle', 13, None), ('sequence', 13, None),
                                         ('fit', 7, dict(target_bs=8, global_window=True))],
                         ids=['fit_one_cycle', 'two-fits', 'global_window'])
def test_a_torch_optimizer_resumes_a_schedule_a_fit_sequence_and_global_window(tmp_path, meth, cut, ga):
    """AdamW behind `OptimWrapper`: fastai's schedule (its hyper-parameters set through the wrapper), cut in the second
    of two fits, windows counted by `global_window`"""
    ref,again,cb,said = _cut_and_resumed(tmp_path, OPTS['torch-AdamW'], meth, cut, ga)
    assert cb.resumed_from is not None and not said, said
    assert all(torch.equal(a, b) for a,b in zip(ref.model.parameters(), again.model.parameters()))
    a,b = _opt_tensors(ref),_opt_tensors(again)
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x,y in zip(a, b))

def test_another_optimizer_is_passed_over_with_one_warning(tmp_path):
    """Checkpoints of torch's SGD resumed with torch's Adam (other options), or fastai's SGD (another form): each file
    passed over with one warning naming the optimizer, nothing applied (the fit trains as a fresh one does)"""
    import shutil
    mk = lambda opt, cbs: make_learner(_data(), 4, cbs=[GradientAccumulation(n_step=2)] + cbs, opt_func=opt, lr=1e-2)
    _fit(mk(OPTS['torch-SGD'], [Checkpoint(tmp_path/'ck', every=('1ep', '3ba')), RaiseAt(7)]), 'fit')
    files = sorted((tmp_path/'ck').glob('ckpt-*.pt'))
    assert files
    for other in ('torch-Adam', 'fastai-SGD-mom'):
        shutil.copytree(tmp_path/'ck', tmp_path/other)
        fresh = _fit(mk(OPTS[other], []), 'fit')
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            again = _fit(mk(OPTS[other], [cb := Checkpoint(tmp_path/other, every=('1ep', '3ba'))]), 'fit')
        msgs = [str(w.message) for w in said if 'passed over' in str(w.message)]
        assert cb.resumed_from is None and len(msgs) == len(files), [str(w.message) for w in said]
        assert all("optimizer's" in m for m in msgs), msgs
        assert all(torch.equal(a, b) for a,b in zip(fresh.model.parameters(), again.model.parameters()))
