"Build, fine-tune and report on an image classifier with gradient accumulation and a BatchNorm mode"
from __future__ import annotations
import contextlib, random, json, time
from pathlib import Path

import torch, torch.nn as nn
from torchvision.models.resnet import BasicBlock
from fastai.learner import Learner
import fastai.callback.schedule, fastai.callback.progress   # `fit_one_cycle`, progress bars
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.torch_core import set_seed

from .accumulate import GradientAccumulation

__all__ = ['ArchError', 'BN_MODES', 'DEFAULT_ARCH', 'ARCHS', 'register_arch', 'resnet_tiny', 'create_model', 'resolve_device', 'describe_device',
           'load_weights', 'auto_bn', 'has_batchnorm', 'build_learner', 'finetune', 'plot_training', 'write_metrics']

BN_MODES = ('auto', 'none', 'pool', 'momentum', 'freeze', 'groupnorm', 'renorm')
DEFAULT_ARCH = 'resnet_tiny'

class ArchError(ValueError):
    "Bad `--arch` or `--weights`: the message names the argument and is shown to the user as one line"

# -- architectures ---------------------------------------------------------------------------------------------
ARCHS = {}
def register_arch(f):
    "Register `f(num_classes) -> nn.Module` under its name for `--arch`"
    ARCHS[f.__name__] = f; return f

class _TinyResNet(nn.Module):
    "A CIFAR-style ResNet (3x3 stem, no max-pool) of torchvision `BasicBlock`s: small enough for a 2-core CPU"
    def __init__(self, num_classes:int=10, widths=(16,32,64), blocks=(1,1,1)):
        super().__init__()
        w0 = widths[0]
        self.stem = nn.Sequential(nn.Conv2d(3, w0, 3, padding=1, bias=False), nn.BatchNorm2d(w0), nn.ReLU(inplace=True))
        layers,c_in = [],w0
        for i,(w,n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                stride = 2 if i and not j else 1
                down = (nn.Sequential(nn.Conv2d(c_in, w, 1, stride, bias=False), nn.BatchNorm2d(w))
                        if stride != 1 or c_in != w else None)
                layers.append(BasicBlock(c_in, w, stride, down)); c_in = w
        self.layers = nn.Sequential(*layers)
        self.pool,self.fc = nn.AdaptiveAvgPool2d(1),nn.Linear(c_in, num_classes)
    def forward(self, x): return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))

@register_arch
def resnet_tiny(num_classes:int=10)->nn.Module:
    "The default: a 3-stage BasicBlock ResNet (16-32-64 channels, 8 BatchNorm layers, ~0.2M parameters)"
    return _TinyResNet(num_classes)

def _torchvision_names():
    import torchvision.models as tvm
    return set(tvm.list_models(module=tvm))

def _timm():
    try: import timm; return timm
    except ImportError: return None

def check_arch(name:str)->str:
    "Where `--arch name` comes from ('registered', 'torchvision', 'timm'), or an `ArchError` saying why not"
    if name in ARCHS: return 'registered'
    is_timm = name.startswith(('timm/', 'timm:'))
    if not is_timm and name in _torchvision_names(): return 'torchvision'
    timm,bare = _timm(),name[5:] if is_timm else name
    if timm is None:
        if is_timm: raise ArchError(f"--arch {name}: timm is not installed (`pip install timm` for timm models)")
        raise ArchError(f"--arch {name}: unknown architecture (not registered, not in torchvision; timm is not "
                        "installed, so timm names are unavailable)")
    if timm.is_model(bare): return 'timm'
    raise ArchError(f"--arch {name}: unknown architecture (not registered, not in torchvision, not in timm)")

def create_model(name:str, num_classes:int)->nn.Module:
    "A randomly initialised `name` (registered, torchvision, or `timm/...`) with a `num_classes` head"
    src = check_arch(name)
    if src == 'registered': return ARCHS[name](num_classes)
    if src == 'torchvision':
        import torchvision.models as tvm
        return tvm.get_model(name, weights=None, num_classes=num_classes)
    bare = name[5:] if name.startswith(('timm/', 'timm:')) else name
    return _timm().create_model(bare, pretrained=False, num_classes=num_classes)

def _hub_state(name:str, weights:str)->dict:
    "State dict of torchvision weights `weights` (e.g. 'DEFAULT', 'IMAGENET1K_V1'), downloaded where the network allows"
    import torchvision.models as tvm
    if check_arch(name) != 'torchvision': raise ArchError(f"--weights {weights}: named weights need a torchvision --arch")
    try: w = tvm.get_model_weights(name)[weights]
    except (KeyError, ValueError): raise ArchError(f"--weights {weights}: no such torchvision weights for {name}") from None
    try: return w.get_state_dict(progress=False)
    except Exception as e:
        raise ArchError(f"--weights {weights}: could not download {w} ({type(e).__name__}); "
                        "pass a local checkpoint with --weights PATH") from None

def load_weights(model:nn.Module, weights:str, arch:str)->int:
    "Load a checkpoint path or torchvision weights name into `model` (head excluded); return how many tensors loaded"
    p = Path(weights)
    if p.is_file():
        try: sd = torch.load(p, map_location='cpu', weights_only=True)
        except Exception as e: raise ArchError(f"--weights {p}: not a readable PyTorch checkpoint ({type(e).__name__})") from None
        if isinstance(sd, dict) and isinstance(sd.get('model'), dict): sd = sd['model']
        if not isinstance(sd, dict): raise ArchError(f"--weights {p}: not a state dict")
    elif p.suffix or '/' in weights or weights.startswith('.'): raise ArchError(f"--weights {weights}: no such file")
    else: sd = _hub_state(arch, weights)
    own = model.state_dict()
    keep = {k:v for k,v in sd.items() if k in own and own[k].shape == v.shape}   # a new head has another shape
    if not keep: raise ArchError(f"--weights {weights}: no tensor matches --arch {arch}")
    model.load_state_dict(keep, strict=False)
    return len(keep)

def resolve_device(spec:str='auto')->torch.device:
    "`auto` (the GPU when there is one), `cpu`, `cuda` or `cuda:N`, checked against what this machine has"
    if spec == 'auto': return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    dev = torch.device(spec)
    if dev.type == 'cuda':
        if not torch.cuda.is_available(): raise ValueError(f"{spec}: no CUDA device on this machine (use --device cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev

def describe_device(dev)->str:
    "'cpu', or 'cuda:0 NVIDIA H100 80GB HBM3'"
    dev = torch.device(dev)
    if dev.type != 'cuda': return dev.type
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    return f'cuda:{i} {torch.cuda.get_device_name(i)}'

def has_batchnorm(model:nn.Module)->bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

# -- BatchNorm mode --------------------------------------------------------------------------------------------
# From the study in `nbs/02_batchnorm_study.ipynb` (numbers in `docs/main_job.md`)
AUTO_FULL_BS = 16   # micro-batches at least this large: plain BatchNorm statistics are as good as the large batch's

def auto_bn(micro_bs:int, n_step:int, pretrained:bool, has_bn:bool=True)->str:
    "The `--bn auto` choice, by micro-batch size and whether the network starts from pretrained weights"
    if not has_bn or n_step == 1 or micro_bs >= AUTO_FULL_BS: return 'none'
    # Measured (docs/study_results.csv, pretrained, 5 seeds; docs/study_scratch.csv, from scratch, 3 seeds): 'pool' was
    # the closest to the large batch at micro-batch 2 both ways (-0.34 and -1.49 points) and within noise of the best
    # at 4. 'freeze', the usual advice for pretrained networks, lost 21 points; 'renorm' and 'groupnorm' lost 0.9-4.3.
    # So the measured choice is the same with and without pretrained weights.
    return 'pool'

def _bn_callback(mode:str):
    "The `BatchNormAccumulation` callback for `mode`, which converts the model itself for 'groupnorm' and 'renorm'"
    if mode == 'none': return None
    try: from .batchnorm import BatchNormAccumulation   # imported here: the CLI works without the BatchNorm modes
    except ImportError as e: raise ArchError(f"--bn {mode}: accum_callback.batchnorm is not available ({e})") from None
    return BatchNormAccumulation(mode)

# -- learner ---------------------------------------------------------------------------------------------------
def build_learner(dls, model:nn.Module, n_step:int, bn:str='none', lr:float=3e-3)->Learner:
    "A fastai `Learner` with exact `GradientAccumulation(n_step)` and the BatchNorm callback for `bn`"
    bn_cb = _bn_callback(bn)
    cbs = [GradientAccumulation(n_step)] + ([bn_cb] if bn_cb is not None else [])
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, lr=lr, cbs=cbs)

def finetune(dls, arch:str=DEFAULT_ARCH, weights:str|None=None, micro_bs:int=4, n_step:int=8, bn:str='auto',
             epochs:int=4, lr:float=3e-3, seed:int=0, progress:bool=True,
             threads:int|None=1)->tuple[Learner,dict]:
    "Fine-tune `arch` (from `weights`) on `dls` with `n_step` micro-batches per step; return the learner and metrics"
    if threads: torch.set_num_threads(threads)
    set_seed(seed, reproducible=True)
    # fastai loaders draw their shuffling seed from Python's `random` when they are built, before this call: reseed
    # them, so that the same `seed` gives the same sample order, whatever ran before in the process
    for i,dl in enumerate(dls.loaders): dl.rng = random.Random(seed+i)
    model = create_model(arch, dls.c)
    n_loaded = load_weights(model, weights, arch) if weights else 0
    pretrained = n_loaded > 0
    mode = auto_bn(micro_bs, n_step, pretrained, has_batchnorm(model)) if bn == 'auto' else bn
    learn = build_learner(dls, model, n_step, mode, lr)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as quiet:
        if not progress: quiet.enter_context(learn.no_bar()); quiet.enter_context(learn.no_logging())
        learn.fit_one_cycle(epochs, lr)
    secs = time.perf_counter()-t0
    rec = learn.recorder
    accs = [float(v[2]) for v in rec.values]
    ga = learn.gradient_accumulation
    metrics = dict(accuracy=accs[-1], valid_loss=float(rec.values[-1][1]), accuracy_per_epoch=accs,
                   micro_bs=micro_bs, effective_bs=micro_bs*n_step, n_step=n_step, bn=mode, bn_requested=bn,
                   epochs=epochs, optimizer_steps=ga.steps, lr=lr, seed=seed, arch=arch,
                   weights=str(weights) if weights else None, pretrained=pretrained,
                   n_train=len(dls.train.dataset), n_valid=len(dls.valid.dataset), train_seconds=round(secs, 1),
                   device=describe_device(next(learn.model.parameters()).device))
    return learn,metrics

# -- outputs ---------------------------------------------------------------------------------------------------
def plot_training(learn:Learner, metrics:dict, fname):
    "PNG of the training curves: window loss against optimizer steps, validation accuracy per epoch"
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig,(a0,a1) = plt.subplots(1, 2, figsize=(10,3.8))
    learn.gradient_accumulation.plot_windows(a0)
    a0.set_title(f"{metrics['micro_bs']} x {metrics['n_step']} = {metrics['effective_bs']} per step, bn={metrics['bn']}")
    accs = metrics['accuracy_per_epoch']
    a1.plot(range(1, len(accs)+1), accs, marker='o')
    a1.set_xlabel('epoch'); a1.set_ylabel('validation accuracy'); a1.set_title(f"final accuracy {accs[-1]:.3f}")
    a1.set_xticks(range(1, len(accs)+1))
    fig.tight_layout(); fig.savefig(fname, dpi=100); plt.close(fig)

def write_metrics(metrics:dict, fname):
    Path(fname).write_text(json.dumps(metrics, indent=2)+'\n')
