.PHONY: setup run test
setup:
	bash ci/setup.sh
run: setup
	.venv/bin/kvxfer pair
test: setup
	bash ci/test.sh
