"Architectures for `accum-finetune`: registered ones, any torchvision or timm model by name, and checkpoint loading"
from __future__ import annotations
from pathlib import Path

import torch, torch.nn as nn
from torchvision.models.resnet import BasicBlock

from .precheck import unknown_arch

__all__ = ['ArchError', 'DEFAULT_ARCH', 'ARCHS', 'register_arch', 'resnet_tiny', 'check_arch', 'create_model',
           'load_weights', 'has_batchnorm']

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
    if timm is not None and timm.is_model(bare): return 'timm'
    raise ArchError(unknown_arch(name, timm is not None))

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
    if check_arch(name) != 'torchvision':
        raise ArchError(f"--weights {weights}: named weights need a torchvision --arch")
    try: w = tvm.get_model_weights(name)[weights]
    except (KeyError, ValueError):
        raise ArchError(f"--weights {weights}: no such torchvision weights for {name}") from None
    try: return w.get_state_dict(progress=False)
    except Exception as e:
        raise ArchError(f"--weights {weights}: could not download {w} ({type(e).__name__}); "
                        "pass a local checkpoint with --weights PATH") from None

def load_weights(model:nn.Module, weights:str, arch:str)->int:
    "Load a checkpoint path or torchvision weights name into `model` (head excluded); return how many tensors loaded"
    p = Path(weights)
    if p.is_file():
        try: sd = torch.load(p, map_location='cpu', weights_only=True)
        except Exception as e:
            raise ArchError(f"--weights {p}: not a readable PyTorch checkpoint ({type(e).__name__})") from None
        if isinstance(sd, dict) and isinstance(sd.get('model'), dict): sd = sd['model']
        if not isinstance(sd, dict): raise ArchError(f"--weights {p}: not a state dict")
    elif p.suffix or '/' in weights or weights.startswith('.'): raise ArchError(f"--weights {weights}: no such file")
    else: sd = _hub_state(arch, weights)
    own = model.state_dict()
    keep = {k:v for k,v in sd.items() if k in own and own[k].shape == v.shape}   # a new head has another shape
    if not keep: raise ArchError(f"--weights {weights}: no tensor matches --arch {arch}")
    model.load_state_dict(keep, strict=False)
    return len(keep)

def has_batchnorm(model:nn.Module)->bool:
    from accum_callback.batchnorm.norm_layers import is_batchnorm
    return any(is_batchnorm(m) for m in model.modules())
