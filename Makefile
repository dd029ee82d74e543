.PHONY: setup run test
# `make run`: the main job, with kvxfer's runtime dependencies only. `make test`: the dev extra
# too, then lint, types, the layers and the whole suite (ci/test.sh).
setup:
	bash ci/setup.sh dev
run:
	bash ci/setup.sh run
	.venv/bin/kvxfer pair
test: setup
	bash ci/test.sh
