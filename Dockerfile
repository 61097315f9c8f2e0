# GPU serving image: lychee-rtc with the lychee engine (Lychee-FD in PyTorch, Token2Wav vocoder) on CUDA.
#
#   docker build -t lychee-rtc .
#   docker run --gpus all --network host \
#       -v /path/to/Lychee-FD/lychee_full_duplex:/models/lychee_full_duplex:ro \
#       -v /path/to/Step-Audio-2-mini/token2wav:/models/token2wav:ro \
#       -v /path/to/voices:/models/voices:ro \
#       lychee-rtc
#
# /models/voices must hold default_male.wav (any prompt WAV; the profile's engine.lychee.token2wav
# lists the voices). To serve speech codes only, without the vocoder:
#   -e LYCHEE_RTC_ENGINE__LYCHEE__TOKEN2WAV=null
#
# The model folder is the released checkpoint (config.json, model-0000i-of-0000N.safetensors +
# model.safetensors.index.json, tokenizer files); it is mounted read-only, never baked in.
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
