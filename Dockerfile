# The kvmesh image: one image for every component (indexer, tee, cache simulator,
# xfer sidecar); the Helm chart picks the command. Build from the repository root:
#   docker build -t kvmesh/kvmesh:0.1.0 .
# WITH_NIXL=0 leaves out NIXL (the xfer sidecar then needs transport tcp).
# tests/install/test_image_install.py runs these steps without Docker: the same
# context (.dockerignore), the same pip commands, then every component the chart runs.

FROM python:3.11-slim AS build
WORKDIR /src
# The whole context: .dockerignore leaves out what the wheel does not need, so no
# package or data file has to be named here.
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ARG WITH_NIXL=1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    # NIXL (DRAM<->DRAM over UCX) without its torch dependency, as in the Makefile.
    && if [ "$WITH_NIXL" = "1" ]; then pip install --no-cache-dir --no-deps nixl-cu12==1.5.1; fi \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvmesh
# Matches the chart's podSecurityContext (runAsNonRoot, uid 10001); the root
# filesystem may be read-only: nothing is written outside /tmp.
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
