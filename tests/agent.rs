//! (being written)
use libtest_mimic::{Arguments, Trial};

fn main() {
    let trials: Vec<Trial> = Vec::new();
    libtest_mimic::run(&Arguments::from_args(), trials).exit();
}
