//! `grpc.health.v1.Health/Check` on the ext_proc port (GAIE protocol, "Health Checking"):
//! `liveness` (the process answers), `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`
//! (a request can be routed: the same test as `/ready`), `""` (the server as a whole: readiness).
//! Another service name is NOT_FOUND, as the health protocol says.

use std::sync::Arc;

use hyper::body::Incoming;
use tokio::sync::mpsc;

use super::grpc::{encode, Code, Out, Status};
use super::pb::{HealthCheckRequest, HealthCheckResponse};
use super::{Epp, Stop, EXT_PROC_SERVICE};
use crate::metrics::HealthLabel;

const SERVING: i32 = 1;
const NOT_SERVING: i32 = 2;

pub(super) async fn check(epp: Arc<Epp>, body: Incoming, tx: mpsc::Sender<Out>) {
    let mut msgs = super::Messages::new(body, 4096);
    let end = match msgs.next::<HealthCheckRequest>().await {
        Err(Stop::Reset) => return,
        Err(Stop::End) => Some(Status::new(Code::InvalidArgument, "no request message")),
        Err(Stop::Error(s)) => Some(s),
        Ok(req) => match msgs.next::<HealthCheckRequest>().await {
            Err(Stop::Reset) => return,
            Err(Stop::Error(s)) => Some(s),
            Ok(_) => Some(Status::new(
                Code::InvalidArgument,
                "a unary call carries one message",
            )),
            Err(Stop::End) => match respond(&epp, &req.service) {
                Err(s) => Some(s),
                Ok(r) => {
                    if tx.send(Out::Message(encode(&r))).await.is_err() {
                        return;
                    }
                    None
                }
            },
        },
    };
    let _ = tx.send(Out::End(end)).await;
}

fn respond(epp: &Epp, service: &str) -> Result<HealthCheckResponse, Status> {
    let (label, serving) = match service {
        "liveness" => ("liveness", true),
        "readiness" => ("readiness", (epp.ready)()),
        "" => ("server", (epp.ready)()),
        EXT_PROC_SERVICE => ("ext_proc", (epp.ready)()),
        _ => {
            epp.proxy
                .metrics
                .epp
                .health_checks
                .get_or_create(&HealthLabel {
                    service: "other",
                    result: "unknown",
                })
                .inc();
            return Err(Status::new(
                Code::NotFound,
                format!("unknown service {service:?}"),
            ));
        }
    };
    epp.proxy
        .metrics
        .epp
        .health_checks
        .get_or_create(&HealthLabel {
            service: label,
            result: if serving { "serving" } else { "not_serving" },
        })
        .inc();
    Ok(HealthCheckResponse {
        status: if serving { SERVING } else { NOT_SERVING },
    })
}
