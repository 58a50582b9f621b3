//! `kubectl gpud`: the cluster's GPUs as gpud's DRA driver publishes them, with what each
//! claim consumes and what is left, per node and GPU. kubectl runs it as a plugin (an
//! executable named `kubectl-gpud` on the PATH); it reads the kubeconfig kubectl would.

use std::process::ExitCode;

use clap::Parser;
use gpud::dra::view::Cli;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;

async fn run(cli: Cli) -> Result<String, String> {
    let dra = gpud::config::DraConfig {
        kubeconfig: cli.kubeconfig,
        ..gpud::config::DraConfig::default()
    };
    let client = gpud::dra::driver::client(&dra).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let claims: Api<ResourceClaim> = Api::all(client);
    let params = ListParams::default();
    let slices = slices
        .list(&params)
        .await
        .map_err(|e| format!("cannot list ResourceSlices: {e}"))?;
    let claims = claims
        .list(&params)
        .await
        .map_err(|e| format!("cannot list ResourceClaims: {e}"))?;
    let view = gpud::dra::view::view(&slices.items, &claims.items);
    Ok(match cli.output.as_str() {
        "json" => serde_json::to_string_pretty(&view).map_err(|e| e.to_string())? + "\n",
        _ => gpud::dra::view::table(&view),
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kubectl-gpud: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kubectl-gpud: {e}");
            ExitCode::FAILURE
        }
    }
}
