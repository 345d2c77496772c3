"""The mistakes a newcomer makes first, each made as a newcomer makes it: one line naming the argument and the fix, said
before anything trains (the weights are checked unchanged where the fit is refused)"""
import warnings
from pathlib import Path
import pytest, torch, torch.nn as nn
from torch.utils.data import TensorDataset
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.callback.training import GradientAccumulation as FastaiGA

from accum_callback import GradientAccumulation, BatchNormAccumulation, Checkpoint, MicroBatching
from accum_callback.resume.format import CheckpointError
from helpers import make_dls

def data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))

def net(bn=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), *([nn.BatchNorm1d(8)] if bn else []), nn.ReLU(), nn.Linear(8, 3))

def learner(cbs, bs=4, loss=None, bn=True, seed=0, **kw):
    learn = Learner(make_dls(data(), bs), net(bn, seed), loss_func=loss or nn.CrossEntropyLoss(), cbs=cbs, **kw)
    learn.recorder.train_metrics = False
    return learn

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]
def same(a, b): return all(torch.equal(x, y) for x,y in zip(a, b))

def refused(learn, match, exc=ValueError, fit=lambda l: l.fit(1, 1e-2)):
    "The fit is refused with `match` in its one line, and nothing trained"
    before = weights(learn)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with pytest.raises(exc, match=match): fit(learn)
    assert same(before, weights(learn)), 'the refused fit changed the weights'

@pytest.mark.parametrize('loss', [nn.CrossEntropyLoss(reduction='none'), CrossEntropyLossFlat(reduction='none')],
                         ids=['torch', 'fastai'])
def test_a_loss_of_reduction_none_is_refused_naming_the_fix(loss):
    refused(learner([GradientAccumulation(n_step=2)], loss=loss), r"reduction='none'.* reduction='mean'")

def test_batchnorm_given_one_item_names_freeze_or_a_larger_micro_batch():
    refused(learner([GradientAccumulation(n_step=2), BatchNormAccumulation('pool')], bs=1),
            r"BatchNorm layer '1' gets 1 value per channel.*BatchNormAccumulation\('freeze'\).*2 or more items")
    # cut to one item by MicroBatching: the same line
    refused(learner([GradientAccumulation(n_step=2), MicroBatching(1)], bs=4), r"BatchNorm layer '1' gets 1 value per channel")

def test_the_fix_trains_and_the_check_leaves_no_hook():
    learn = learner([GradientAccumulation(n_step=2), BatchNormAccumulation('freeze')], bs=1)
    before = weights(learn)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, 1e-2)
    assert not same(before, weights(learn)) and learn.gradient_accumulation.steps == 24
    assert not any(m._forward_pre_hooks for m in learn.model.modules())
    # micro-batches of 2 with BatchNorm training: nothing said, and no hook left either
    learn = learner([GradientAccumulation(n_step=2)], bs=2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, 1e-2)
    assert learn.gradient_accumulation.steps == 12 and not any(m._forward_pre_hooks for m in learn.model.modules())

def fit_quietly(learn, fit=lambda l: l.fit(1, 1e-2)):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        fit(learn)

@pytest.mark.parametrize('n,bs,cut,said', [
    (49, 4, None, r"\(the epoch's last batch: the loader's bs=4 with drop_last=False leaves 1 item\).*drop_last=True"),
    (47, 4, 2, r"\(MicroBatching\(2\) cut a loader batch of 3 items into pieces of 1\).*micro_bs=2")],
    ids=['last-batch', 'cut'])
def test_a_micro_batch_of_one_later_in_the_fit_is_said_too(n, bs, cut, said):
    "The check stays on the whole fit: a micro-batch of 1 after others of 4 (the epoch's last, a cut) is said in one line"
    learn = Learner(make_dls(data(n), bs), net(), loss_func=nn.CrossEntropyLoss(),
                    cbs=[GradientAccumulation(n_step=2)] + ([MicroBatching(cut)] if cut else []))
    with pytest.raises(ValueError, match=r"BatchNorm layer '1' gets 1 value per channel: a micro-batch of 1 item " + said):
        fit_quietly(learn)
    assert learn.gradient_accumulation.steps > 0 and not any(m._forward_pre_hooks for m in learn.model.modules())

def test_the_one_item_check_passes_over_eval_and_window_modes():
    "A layer in eval mode (validation, frozen) given 1 item is not checked; the 'window' modes normalise 1 item over the window"
    from accum_callback.window.accumulate import one_value_hooks
    learn = learner([GradientAccumulation(n_step=2)], bs=1)
    hooks = one_value_hooks(learn)
    with torch.no_grad():
        learn.model.eval(); learn.model(torch.randn(1, 6))
        learn.model.train()
        with pytest.raises(ValueError, match="gets 1 value per channel"): learn.model(torch.randn(1, 6))
    for h in hooks: h.remove()
    learn = learner([GradientAccumulation(n_step=1), MicroBatching(1), BatchNormAccumulation('window')], bs=4)
    fit_quietly(learn)
    assert learn.gradient_accumulation.steps == 12

def image_folder(path, n_train=2, n_valid=1):
    "A tiny `from_folder` dataset: train/ and valid/, two classes of 32x32 images"
    from PIL import Image
    for split,n in (('train', n_train), ('valid', n_valid)):
        for k,c in enumerate(('cat', 'dog')):
            (path/split/c).mkdir(parents=True)
            for i in range(n): Image.new('RGB', (32, 32), (40*i, 0, 200*k)).save(path/split/c/f'{i}.png')
    return path

def test_vision_learner_at_bs_1_is_said_in_one_line_and_the_fix_trains(tmp_path):
    "A newcomer's first fine-tune at bs=1: a resnet's BatchNorm layers (body and head) are said, not torch's deep error"
    from fastai.vision.all import ImageDataLoaders, Resize, resnet18, vision_learner
    dls = lambda: ImageDataLoaders.from_folder(image_folder(tmp_path), bs=1, item_tfms=Resize(32), device='cpu', num_workers=0)
    learn = vision_learner(dls(), resnet18, pretrained=False, cbs=[GradientAccumulation(n_step=4)])
    refused(learn, r"BatchNorm layer '.+' gets 1 value per channel: a micro-batch of 1 item \(the loader's bs=1\).*"
                   r"BatchNormAccumulation\('groupnorm'\).*the loader's bs=2 or more", fit=lambda l: l.fine_tune(1))
    assert not any(m._forward_pre_hooks for m in learn.model.modules())
    learn = vision_learner(learn.dls, resnet18, pretrained=False, cbs=[GradientAccumulation(n_step=4), BatchNormAccumulation('groupnorm')])
    fit_quietly(learn, lambda l: l.fit(1, 1e-3))
    assert learn.gradient_accumulation.steps == 1

BLOCKED_LOAD = """
import sys, warnings
class Hide:   # a machine without accum_callback
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'accum_callback': raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hide())
warnings.simplefilter('ignore')
from fastai.learner import load_learner
try: learn = load_learner(sys.argv[1])
except Exception as e: print('FAILED', type(e).__name__); raise SystemExit(0)
print('LOADED', repr(learn.predict(sys.argv[2])[0]), 'accum_callback' in sys.modules)
"""

def exportable(tmp_path):
    from fastai.vision.all import ImageDataLoaders, Resize
    dls = ImageDataLoaders.from_folder(image_folder(tmp_path/'imgs'), bs=2, item_tfms=Resize(32), device='cpu', num_workers=0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(dls, model, path=tmp_path, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool')])
    fit_quietly(learn)
    return learn

FIX = "with learn.removed_cbs([learn.gradient_accumulation, learn.batch_norm_accumulation]): learn.export()"
def said_of_pickling(f):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        f()
    return [w for w in said if 'accum_callback' in str(w.message)]

def test_learn_export_with_ours_says_so_at_the_users_line(tmp_path):
    """fastai's `export` pickles under `simplefilter('ignore')`: the line is said through it, at the user's line, with
    the fix; a deepcopy and the fix say nothing, and a filter naming the line silences it"""
    import copy
    learn = exportable(tmp_path)
    said = said_of_pickling(lambda: learn.export('with_ours.pkl'))
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in said]
    assert 'load_learner needs accum_callback installed where it loads' in str(said[0].message) and FIX in str(said[0].message)
    assert not said_of_pickling(lambda: copy.deepcopy(learn))
    def fixed():
        with learn.removed_cbs([learn.gradient_accumulation, learn.batch_norm_accumulation]): learn.export('without.pkl')
    assert not said_of_pickling(fixed)
    assert learn.gradient_accumulation in learn.cbs and learn.batch_norm_accumulation in learn.cbs   # (put back after)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always'); warnings.filterwarnings('ignore', message='The Learner is pickled')
        learn.export('again.pkl')
    assert not [w for w in said if 'accum_callback' in str(w.message)]

def test_an_exported_learner_with_ours_needs_the_package_and_the_fix_loads_without_it(tmp_path):
    "Loaded where accum_callback cannot be imported: with ours fastai's UnboundLocalError; the fix loads and predicts"
    import subprocess, sys
    learn = exportable(tmp_path)
    load = lambda f: subprocess.run([sys.executable, '-c', BLOCKED_LOAD, str(tmp_path/f), str(tmp_path/'imgs'/'valid'/'dog'/'0.png')],
                                    capture_output=True, text=True, timeout=300)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.export('with_ours.pkl')
        with learn.removed_cbs([learn.gradient_accumulation, learn.batch_norm_accumulation]): learn.export('without.pkl')
    assert load('with_ours.pkl').stdout.split() == ['FAILED', 'UnboundLocalError']   # fastai swallows the ImportError
    res = load('without.pkl')
    assert 'LOADED' in res.stdout, res.stderr[-2000:]
    assert res.stdout[res.stdout.index('LOADED'):].split() == ['LOADED', repr(learn.predict(tmp_path/'imgs'/'valid'/'dog'/'0.png')[0]), 'False']

def test_the_class_instead_of_an_instance_names_the_fix():
    "`cbs=GradientAccumulation`: fastai makes one with no arguments; the line says so, with the instance to pass"
    with pytest.raises(TypeError, match=r"needs its window.*`cbs=GradientAccumulation`, the class.*GradientAccumulation\(n_step=8\)"):
        learner(GradientAccumulation)

def test_a_model_holding_our_layers_says_the_package_is_needed():
    learn = learner([GradientAccumulation(n_step=2), BatchNormAccumulation('renorm')])
    fit_quietly(learn)
    with pytest.warns(UserWarning, match=r"its model holds accum_callback's BatchRenorm1d too: load it where accum_callback is installed"):
        torch.save(learn, __import__('io').BytesIO())

def test_fastai_accumulation_alone_is_said_as_the_learner_is_made():
    "The name rebound by a star import after ours, with none of ours on the Learner: said by `Learner(...)`, at the user's line"
    with pytest.warns(UserWarning, match=r"fastai's GradientAccumulation, not accum_callback's.*learn.accumulate\(n_acc=") as said:
        learn = learner([FastaiGA(8)])
    assert [w.filename for w in said if "fastai's Grad" in str(w.message)] == [__file__]
    assert [type(cb).__name__ for cb in learn.cbs][-1] == 'GradientAccumulation' and isinstance(learn.cbs[-1], FastaiGA)
    assert not any('accum_callback' in type(cb).__module__ for cb in learn.cbs)   # (the check left the Learner)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        learner([GradientAccumulation(n_step=2)]); learner([])
    assert not [w for w in said if "fastai's GradientAccumulation" in str(w.message)]

def test_fastai_callback_under_our_name_is_said_at_fit_start(tmp_path):
    "The star import's shadow: fastai's callback beside ours is said in one line; ours alone says nothing of it"
    learn = learner([FastaiGA(8), Checkpoint(tmp_path/'a')])
    with pytest.warns(UserWarning, match=r"fastai's GradientAccumulation, not accum_callback's.*learn.accumulate\(n_acc="):
        learn.fit(1, 1e-2)
    learn = learner([GradientAccumulation(n_step=2), Checkpoint(tmp_path/'b')])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        learn.fit(1, 1e-2)
    assert not [w for w in said if "fastai's GradientAccumulation" in str(w.message)]

def test_a_changed_lr_under_checkpoint_says_the_values(tmp_path):
    cbs = lambda: [GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ckpt')]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learner(cbs()).fit_one_cycle(1, 3e-3)
    refused(learner(cbs()), r"lr_max 0.003 then, 0.01 now.*resume=False\) or another `path`", CheckpointError,
            fit=lambda l: l.fit_one_cycle(1, 1e-2))

def test_a_seed_sweep_in_one_folder_says_a_folder_a_run(tmp_path):
    "Another seed, the same data and arguments, one folder: the second run is told to take a folder of its own"
    fit = lambda learn: learn.fit(1, 1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        fit(first := learner([GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ckpt')], seed=0))
    second = learner([GradientAccumulation(n_step=2), Checkpoint(tmp_path/'ckpt')], seed=1)
    with pytest.warns(UserWarning, match=r"this fit finished before.*a folder of its own: Checkpoint\(f'checkpoints/seed\{seed\}'\)"):
        fit(second)
    assert same(weights(first), weights(second))   # (what the line says: the first one's weights)
    # a folder a run: each trains
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        fit(third := learner([GradientAccumulation(n_step=2), Checkpoint(tmp_path/'seed1')], seed=1))
    assert not same(weights(first), weights(third)) and third.gradient_accumulation.steps == 6

def test_the_window_in_one_line():
    ga = GradientAccumulation(n_step=8)
    assert repr(ga) == 'GradientAccumulation(n_step=8): 8 micro-batches per optimizer step'
    learn = learner([ga])
    assert repr(learn.gradient_accumulation) == 'GradientAccumulation(n_step=8): 4 x 8 = 32 per step'
    assert repr(learner([GradientAccumulation(target_bs=30)]).gradient_accumulation).endswith(': 4 x 8 = 32 per step')
    learn = learner([GradientAccumulation(n_step=2), MicroBatching(2)])
    assert repr(learn.gradient_accumulation).endswith('4 x 2 = 8 per step (each loader batch of 4 in 2 micro-batches of 2)')
    assert repr(MicroBatching(2)) == 'MicroBatching(2)' and repr(MicroBatching('auto')) == "MicroBatching('auto')"

def test_plot_loss_counts_optimizer_steps():
    import matplotlib; matplotlib.use('Agg')
    learn = learner([GradientAccumulation(n_step=4)], bn=False)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(2, 1e-2)
    ga = learn.gradient_accumulation
    ax = ga.plot_loss()
    train,valid = ax.lines
    assert ax.get_xlabel() == 'optimizer step' and list(train.get_xdata()) == list(range(1, ga.steps+1)) == list(range(1, 7))
    assert list(valid.get_xdata()) == [3, 6] and list(valid.get_ydata()) == [v[1] for v in learn.recorder.values]

def test_the_job_passes_over_what_training_wrote_in_the_image_folder(tmp_path, capsys):
    from PIL import Image
    from accum_finetune.data import DataError, check_folder
    for c in ('cat', 'dog'):
        (tmp_path/c).mkdir()
        for i in range(3): Image.new('RGB', (8, 8), (40*i, 0, 0)).save(tmp_path/c/f'{i}.png')
    (tmp_path/'models').mkdir()                                      # what lr_find leaves
    (tmp_path/'ckpt').mkdir(); (tmp_path/'ckpt'/'ckpt-000001.rank0.pt').write_bytes(b'x')   # Checkpoint('ckpt')
    assert set(check_folder(tmp_path)['all']) == {'cat', 'dog'}
    # any folder without image files is no class, as in fastai's from_folder: a checkpoint folder with another name,
    # emptied or holding a write cut short, passed over; one that is not training's, in one line
    from fastai.vision.all import ImageDataLoaders
    (tmp_path/'run1').mkdir(); (tmp_path/'run1'/'.ckpt-000002.rank0.pt.7.part').write_bytes(b'x')
    (tmp_path/'bird').mkdir(); (tmp_path/'notes').mkdir(); (tmp_path/'notes'/'todo.txt').write_text('x')
    assert set(check_folder(tmp_path)['all']) == {'cat', 'dog'}
    said = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(said) == 2 and all("holds no image files: passed over, not a class" in l for l in said), said
    assert {Path(l.split(': ')[2].split(' holds')[0]).name for l in said} == {'bird', 'notes'}
    fastai = ImageDataLoaders.from_folder(tmp_path, valid_pct=0.5, bs=2, device='cpu', num_workers=0)
    assert list(fastai.vocab) == ['cat', 'dog']   # (fastai's own labels: the same two)
    # passing over leaves one class: said so
    for c in ('dog',): [f.unlink() for f in (tmp_path/c).iterdir()]
    with pytest.raises(DataError, match=r'only one class folder \(cat\); need at least 2'): check_folder(tmp_path)
