# Sourced by the GPU scripts: packages the GPU machine lacks (xgrammar, apache-tvm-ffi, the server's) travel as
# wheels in .whl/ (pip download --no-deps --python-version 3.12 --only-binary=:all: ... -d .whl) and are installed
# into /tmp/site, which joins PYTHONPATH. Nothing happens without .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || exit 1
fi
