//! deploy/ as the API server reads it: every document parses, every object
//! is of a kind this test knows, and every field in it exists in that
//! kind's schema (the Kubernetes types from k8s-openapi: a field they do
//! not know is dropped on the round trip and shows as a difference). The
//! kustomizations name only files that exist, and every one that can be
//! applied renders with `kubectl kustomize` into objects checked the same
//! way and against the rendered CRDs, with the agent's image as
//! deploy/image/build.sh tags it and every other image pinned by digest.
//! Every program the agent runs is in the image's package list. No cluster
//! is involved.
//! The checks live in one module per theme (objects.rs, kustomize.rs,
//! programs.rs); this file holds the list of trials.

#[path = "../deploy_support/mod.rs"]
mod deploy_support;

mod kustomize;
mod objects;
mod programs;

use std::path::{Path, PathBuf};

use libtest_mimic::{Failed, Trial};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use kustomize::{
    a_wrong_rendering_is_caught, every_kustomization_renders_and_checks, kustomizations_name_files_that_exist,
    the_admission_policy_admits_only_the_agents_own_writes,
};
use objects::{a_misspelt_field_is_caught, every_object_is_a_known_kind_with_known_fields};
use programs::every_program_the_agent_runs_is_in_the_image;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let trials = vec![
        Trial::test("deploy::every_object_is_a_known_kind_with_known_fields", every_object_is_a_known_kind_with_known_fields),
        Trial::test("deploy::a_misspelt_field_is_caught", a_misspelt_field_is_caught),
        Trial::test("deploy::kustomizations_name_files_that_exist", kustomizations_name_files_that_exist),
        Trial::test("deploy::every_kustomization_renders_and_checks", every_kustomization_renders_and_checks),
        Trial::test("deploy::a_wrong_rendering_is_caught", a_wrong_rendering_is_caught),
        Trial::test(
            "deploy::the_admission_policy_admits_only_the_agents_own_writes",
            the_admission_policy_admits_only_the_agents_own_writes,
        ),
        Trial::test("deploy::every_program_the_agent_runs_is_in_the_image", every_program_the_agent_runs_is_in_the_image),
    ];
    libtest_mimic::run(&args, trials).exit();
}
