.PHONY: setup run test
setup:
	bash ci/setup.sh
run: setup
	.venv/bin/python examples/loopback_roundtrip.py
test: setup
	bash ci/test.sh
