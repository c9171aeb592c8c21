fn main() -> std::process::ExitCode {
    harvester_node_agent::cli::main()
}
