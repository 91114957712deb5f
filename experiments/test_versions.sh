#!/usr/bin/env bash
# The quick pass of the tests against each transformers release we claim, each in its own environment
# (.venvs/transformers-X.Y.Z, made on first use by setup_env.sh with that release installed after the project):
#
#     bash experiments/test_versions.sh                  # the oldest and the newest we claim: 5.23.0 and 5.25.0
#     bash experiments/test_versions.sh 5.24.0           # the releases named
#     PYTEST_ARGS="tests -x" bash experiments/test_versions.sh 5.25.0   # other pytest arguments (default: the quick pass)
#
# Prints one line per release: its pytest summary and wall time; the logs go to results/versions/.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VERSIONS=("${@:-5.23.0 5.25.0}")
read -r -a VERSIONS <<< "${VERSIONS[*]}"
PYTEST_ARGS="${PYTEST_ARGS:-tests -m not\ slow -q -p no:cacheprovider}"
mkdir -p results/versions
for version in "${VERSIONS[@]}"; do
    venv="$ROOT/.venvs/transformers-$version"
    if [ ! -f "$venv/.transformers_$version" ]; then
        VENV="$venv" ./setup_env.sh > "results/versions/setup-$version.log" 2>&1 || { echo "$version: setup failed"; continue; }
        "$venv/bin/python" -m pip install --quiet "transformers==$version" >> "results/versions/setup-$version.log" 2>&1 \
            && touch "$venv/.transformers_$version" || { echo "$version: install failed"; continue; }
    fi
    start=$SECONDS
    eval "\"$venv/bin/python\" -m pytest $PYTEST_ARGS" > "results/versions/tests-$version.log" 2>&1
    status=$?
    summary=$(tail -1 "results/versions/tests-$version.log")
    echo "transformers $version: exit $status, $summary ($((SECONDS - start)) s wall; results/versions/tests-$version.log)"
done
