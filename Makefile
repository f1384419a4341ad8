# make test: install everything (Debian packages, .venv, parallel h5py) and run the whole suite.
# make run:  install everything and train the digits classifier (jobs/train.py) on 2 ranks.
.PHONY: setup test run bench clean

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/test.sh

run: setup
	scripts/mpirun --limit 300 -n 2 .venv/bin/python jobs/train.py

bench: setup
	bash scripts/bench.sh

clean:
	rm -rf out .pytest_cache build *.egg-info
