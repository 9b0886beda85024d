# Sourced by bench/gpu_box.sh and bench/gpu_fleet.sh on the GPU machine, from the repository
# root: installs the wheels `make gpu-pack` packed into /tmp/site, puts it, operator/ and
# runtime_image/ first on PYTHONPATH, and prints any requirement the machine does not meet.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu-pack/wheels/*.whl
export PYTHONPATH="/tmp/site:$PWD/operator:$PWD/runtime_image${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 bench/gpu_pack.py verify /tmp/site
