//! `forge`: the batch_forge command line.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let argv = cli::expand_aliases(std::env::args_os().skip(1).collect());
    if let Some(msg) = cli::unsupported_flag(&argv) {
        eprintln!("error: {msg}");
        return ExitCode::FAILURE;
    }
    let args = cli::Cli::parse_from(std::iter::once("forge".into()).chain(argv));
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if cli::is_broken_pipe(&e) {
                return ExitCode::SUCCESS;
            }
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
