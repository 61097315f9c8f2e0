# GPU serving image: lychee-rtc with the lychee engine (Lychee-FD in PyTorch, Token2Wav vocoder) on CUDA.
#
#   lychee-rtc download                # on the host, once: both folders into the Hugging Face cache
#   docker build -t lychee-rtc .
#   docker run --gpus all --network host -v ~/.cache/huggingface:/root/.cache/huggingface:ro lychee-rtc
#
# The profile names the weights as hf:// references, found in the mounted cache without network
# access (the weights are never baked in). Folders work too: `lychee-rtc download --dir /path/models`,
# then -v /path/models:/models:ro -e LYCHEE_RTC_ENGINE__LYCHEE__MODEL_ROOT=/models/lychee_full_duplex
# -e LYCHEE_RTC_ENGINE__LYCHEE__TOKEN2WAV__FOLDER=/models/token2wav. The voice is the built-in prompt
# unless the profile (engine.lychee.token2wav.voices) names recordings mounted into the container.
# To serve speech codes only, without the vocoder: -e LYCHEE_RTC_ENGINE__LYCHEE__TOKEN2WAV=null
#
# --network host: WebRTC media uses UDP ports chosen per session (ICE host candidates), which a
# bridged container would not expose. Other profiles: append `serve --config lychee-c4` (a profile
# shipped with the package, by name) or mount your own and pass its path.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first (cached layer): the package metadata only, with a stub package to satisfy
# setuptools. torch and torchaudio come from the base image and are pinned to it, so no dependency
# can pull in another torch built for another CUDA.
COPY pyproject.toml setup.py MANIFEST.in README.md ./
RUN python -c "import torch, torchaudio; print(f'torch=={torch.__version__}'); print(f'torchaudio=={torchaudio.__version__}')" \
        > /tmp/base-constraints.txt \
    && mkdir -p lychee_rtc web signaling configs && touch lychee_rtc/__init__.py \
    && pip install --constraint /tmp/base-constraints.txt ".[model]" \
    && pip uninstall -y lychee-rtc \
    && rm -rf lychee_rtc web signaling configs build

COPY lychee_rtc ./lychee_rtc
COPY configs ./configs
COPY web ./web
COPY signaling ./signaling
# A regular install: the wheel carries web/, signaling/ and configs/ inside the package.
RUN pip install --no-deps . && rm -rf /app/* /app/.[!.]*

VOLUME ["/models"]
EXPOSE 8080

ENTRYPOINT ["lychee-rtc"]
CMD ["serve", "--config", "lychee-c1"]
