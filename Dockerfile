# rltpu on a Ray image, for the head and every TPU worker pod of a KubeRay cluster (docs/tpu.md,
# "A v5e 2x4 slice on GKE with KubeRay"). Build from the repository root and push where GKE pulls from:
#
#   docker build -t $REGISTRY/rltpu:0.1.0 . && docker push $REGISTRY/rltpu:0.1.0
#
# image: $REGISTRY/rltpu:0.1.0   (the manifest names exactly this; tests/test_kuberay_manifest.py checks it)
#
# The base is Ray's own image at the Ray version pyproject.toml pins, for Python 3.11 (tags are
# {Ray version}-py{Python}[-cpu|-cuXX|-gpu]; no platform suffix = the CPU image, which is what a TPU
# host wants: no CUDA). Its Python is /home/ray/anaconda3, run as user `ray`; KubeRay runs `ray start`
# in it. Nothing is installed on the TPU host itself: the image is the whole environment.
FROM rayproject/ray:2.60.0-py311

LABEL org.opencontainers.image.title="rltpu" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="rltpu with the tpu, hf and data extras on Ray 2.60.0 (Python 3.11)"

WORKDIR /home/ray/rltpu

# torch first, from the CPU wheel index: the TPU path never uses CUDA, and PyPI's Linux torch wheel
# pulls several GB of nvidia-* packages. The same pin as pyproject.toml (torch-tpu 0.2.0 is built for it).
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The project with the tpu extra (torch-tpu and libtpu for the trainers), hf (tokenizers, chat
# templates) and data (Parquet prompts). Not editable: the code lives in the image's site-packages, and
# the repository copy stays for configs/ (`rltpu train configs/...` from this directory).
# JAX (samplers) and TorchTPU (trainers) may want different libtpu builds: jax[tpu]==0.10.2 pins
# libtpu==0.0.42.*, torch-tpu 0.2.0 needs libtpu>=0.0.50 (docs/tpu.md, Install); the tpu extra
# installs the TorchTPU one.
COPY --chown=ray:users . /home/ray/rltpu
RUN pip install --no-cache-dir '.[tpu,hf,data]'

# libtpu for JAX samplers: see docs/tpu.md ("Two libtpu builds"). JAX's build goes beside the package one,
# in <prefix>/libtpu-jax, where rltpu.chips.libtpu finds it; the pin is read from jax's own metadata.
RUN pip install --no-cache-dir --no-deps --target /home/ray/anaconda3/libtpu-jax \
      "libtpu$(python -c 'from rltpu.chips.libtpu import requirement; print(requirement("jax"))')"

# Fail the build, not the first run, when the image lacks a piece: rltpu and its actor packages import,
# the CLI starts, and torch_tpu imports (it finds no TPU device here, which is expected at build time).
RUN python -c "import rltpu, actors, learner, jax, torch, torch_tpu, ray; assert ray.__version__ == '2.60.0'" \
 && python -c "from rltpu.chips.libtpu import select; select('jax'); select('torch_tpu')" \
 && rltpu --help > /dev/null
