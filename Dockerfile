# syntax=docker/dockerfile:1
# The trainer image: the PyTorchJob (supernode.trainer.train), the interconnect gate (supernode.trainer.node.fabric) and the
# drills run it. Build and push with `make image STACK=<stack>`; the digest it prints goes into
# supernode:images.trainer.
#
# Versions match the EKS-optimised AL2023 NVIDIA AMI of the node groups (amiReleaseVersion
# 1.33.5-20251120): its R580 driver runs CUDA <= 13.0 user space, so the base is CUDA 13.0 and torch
# is the cu130 build. The AMI brings the EFA kernel module; the EFA user space (libfabric, rdma-core)
# comes from the EFA installer and the NCCL network plugin (aws-ofi-nccl) is built against it here.
# README "Trainer image" lists the versions and how they were checked.
#
# The CUDA base is pinned by digest. CUDA_DIGEST's default is a PLACEHOLDER in the format of a
# digest, not a published one (a digest cannot be resolved offline): `make image` resolves the
# digest of CUDA_IMAGE (`docker buildx imagetools inspect`) and passes it with --build-arg;
# `make image CUDA_DIGEST=sha256:...` pins one you have reviewed.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG CUDA_DIGEST=sha256:4b3c8d0a6f1e9d2c7b5a8e3f0d6c1b9a4e7f2d8c5b0a3e6f9d1c4b7a0e3f6d9c

# -- efa: CUDA runtime + EFA user space (no kernel module: the AMI has it) ---------------------------
FROM ${CUDA_IMAGE}@${CUDA_DIGEST} AS efa
ARG EFA_INSTALLER_VERSION=1.43.3
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /tmp/efa
RUN curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar -xz
WORKDIR /tmp/efa/aws-efa-installer
# --skip-plugin: aws-ofi-nccl is built below at its own pinned version; --skip-mpi: torchrun, not MPI.
RUN ./efa_installer.sh -y --skip-kmod --skip-limit-conf --skip-mpi --skip-plugin --no-verify \
 && rm -rf /tmp/efa /var/lib/apt/lists/*
WORKDIR /

# -- plugin: aws-ofi-nccl against this libfabric and CUDA ------------------------------------------
FROM efa AS plugin
ARG AWS_OFI_NCCL_VERSION=1.17.2
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG CUDA_DEV_PACKAGES="cuda-cudart-dev-13-0 cuda-driver-dev-13-0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends autoconf automake libtool make gcc g++ libhwloc-dev \
      ${CUDA_DEV_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /tmp/ofi
RUN curl -fsSL "https://github.com/aws/aws-ofi-nccl/releases/download/v${AWS_OFI_NCCL_VERSION}/aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
      | tar -xz --strip-components=1 \
 && ./configure --prefix=/opt/aws-ofi-nccl --with-libfabric=/opt/amazon/efa --with-cuda=/usr/local/cuda \
      --enable-platform-aws --disable-tests \
 && make -j"$(nproc)" \
 && make install

# -- wheel: this package, built as `pip install .` would ------------------------------------------
FROM efa AS wheel
WORKDIR /src
COPY pyproject.toml requirements.txt ./
COPY supernode supernode
COPY components components
COPY trainer trainer
COPY policies policies
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- trainer: what runs in the cluster -------------------------------------------------------------
FROM efa AS trainer
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu130
ENV PATH=/opt/venv/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/aws-ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY requirements.txt /tmp/requirements.txt
# torch from its CUDA index; the trainer's other dependencies at requirements.txt's exact pins (the
# pulumi/test half of the project is not needed in the cluster). The management page (`supernode ui
# --cluster`, components/k8s/management_ui.py) runs this image too: its server, the Kubernetes client,
# boto3 for its audit records and cryptography for the load balancer's signed identity.
RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}" \
 && grep -E '^(numpy|pydantic|pyyaml|prometheus-client|matplotlib|rich|starlette|uvicorn|jinja2|python-multipart|kubernetes|boto3|botocore|cryptography)==' /tmp/requirements.txt > /tmp/trainer.txt \
 && pip install --no-cache-dir -r /tmp/trainer.txt \
 && rm /tmp/requirements.txt /tmp/trainer.txt
COPY --from=plugin /opt/aws-ofi-nccl /opt/aws-ofi-nccl
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin trainer
USER 10001
WORKDIR /home/trainer
# The jobs set the command (torchrun --module supernode.trainer.train | supernode.trainer.node.fabric); this checks the image.
CMD ["python", "-c", "import torch, supernode.trainer.train, supernode.trainer.node.fabric; print(torch.__version__, torch.version.cuda)"]
