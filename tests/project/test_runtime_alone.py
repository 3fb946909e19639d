"""The runtime needs torch, NumPy, Numba and xxhash alone: in a fresh interpreter that refuses the course's libraries
(matplotlib, ipywidgets, IPython, tqdm, jupyter*, nbformat) and the integrations' (transformers, accelerate,
lightning), every module of minioffload outside minioffload.course imports (of minioffload.integrations, the package
itself: each framework's module needs its framework), and a small model trains with OffloadAdam on the simulated
device."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import importlib
    import importlib.abc
    import importlib.util
    import pkgutil
    import sys

    REFUSED = ("matplotlib", "ipywidgets", "IPython", "tqdm", "nbformat",
               "transformers", "accelerate", "lightning", "pytorch_lightning")
    PACKAGE = importlib.util.find_spec("minioffload").submodule_search_locations[0]
    asked = set()  # (library, runtime file) for each runtime module that itself asked for one


    def refused(name):
        top = name.partition(".")[0]
        return top in REFUSED or top.startswith("jupyter")


    class Without:
        """A finder that finds what the finder it wraps finds, except the course's libraries: as if they were not
        installed (an import raises ModuleNotFoundError, importlib.util.find_spec returns None). It notes which
        runtime module asked; a library's own optional import (torch.hub's of tqdm) is the library's business."""

        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if not refused(name):
                return self.finder.find_spec(name, path, target)
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back  # the import machinery's own frames
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                asked.add((name, frame.f_code.co_filename))
            return None

        def __getattr__(self, attribute):  # invalidate_caches, find_distributions, ...
            return getattr(self.finder, attribute)


    sys.meta_path[:] = [Without(finder) for finder in sys.meta_path]
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in REFUSED or m.startswith("jupyter"))
    assert not loaded, f"already imported before the test began: {loaded}"

    import minioffload


    def runtime_modules(path, prefix):
        """Every module under `path` but the course and the CLI's entry point, imported (not walk_packages, which
        would import the course's packages to look inside them)."""
        for module in pkgutil.iter_modules(path, prefix):
            if module.name in ("minioffload.course", "minioffload.cli.main"):
                continue
            imported = importlib.import_module(module.name)
            yield module.name
            if module.ispkg and module.name != "minioffload.integrations":
                yield from runtime_modules(imported.__path__, module.name + ".")


    names = sorted(runtime_modules(minioffload.__path__, "minioffload."))
    assert "minioffload.engine.optimizer" in names and "minioffload.devices.sim" in names, names
    assert not any(m.startswith("minioffload.course") for m in sys.modules), "a runtime module imported the course"
    assert not asked, f"runtime modules asked for course-only libraries: {asked}"

    import torch
    from torch import nn

    from minioffload.devices import device
    from minioffload.engine.optimizer import OffloadAdam

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 8)
    y = x[:, :1] * 0.5 - x[:, 1:2]
    losses = []
    with device("sim") as dev:
        dev.place(model)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3)
        for _ in range(20):
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        dev.synchronize()
    assert losses[-1] < 0.95 * losses[0], losses
    assert not asked, f"training asked for course-only libraries: {asked}"
    print(f"imported {len(names)} runtime modules; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
''')


def test_the_runtime_imports_and_trains_without_the_course_libraries():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime modules; loss" in result.stdout
