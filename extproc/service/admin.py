"""The Admin gRPC service (proto/admin.proto): switch policy/knobs, reset state, read state."""

from __future__ import annotations

import grpc

from extproc.routing.placement import Placement
from extproc.routing.settings import with_knobs
from extproc.routing.speeds import Speed
from extproc.service import admin_pb2, admin_pb2_grpc
from extproc.service.gateway import Gateway
from extproc.settings import SettingsError, parse_routing, toml_text, toml_value


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def SetRouting(
        self, request: admin_pb2.SetRoutingRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.State:
        changes = {key: toml_value(text) for key, text in request.routing.knobs.items()}
        try:
            settings = parse_routing(with_knobs(self.gateway.router.settings.table(), changes), source="SetRouting")
        except SettingsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.gateway.router.reconfigure(settings)
        return self.state()

    async def Reset(self, request: admin_pb2.ResetRequest, context: grpc.aio.ServicerContext) -> admin_pb2.State:
        self.gateway.router.reset()
        self.gateway.conversations.forget()  # a reset begins on emptied caches: what was sent there is gone
        if self.gateway.store is not None:  # the others must stop counting what was forgotten here
            self.gateway.store.load_changed()
        return self.state()

    async def GetState(self, request: admin_pb2.StateRequest, context: grpc.aio.ServicerContext) -> admin_pb2.State:
        return self.state()

    async def Placements(
        self, request: admin_pb2.PlacementsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PlacementsReply:
        migrations = self.gateway.migrations
        return admin_pb2.PlacementsReply(conversations=[
            admin_pb2.ConversationPlacement(key=key, opening=migrations.opening(key), prompt_tokens=tokens)
            for key, tokens in self.gateway.router.placed_on(request.replica)
        ])

    async def Migrated(
        self, request: admin_pb2.MigratedRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.MigratedReply:
        gateway = self.gateway
        router, migrations, memory = gateway.router, gateway.migrations, gateway.reader.block_memory
        applied = 0
        for move in request.moves:  # the prefix index learns the last prompt's blocks, which the body cache kept
            blocks = memory.last(migrations.blocks_key(move.key)) if memory is not None else ()
            if router.migrated(move.key, move.replica, move.tokens, blocks):
                applied += 1
                gateway.leaving.moved(move.key, move.replica)
                if gateway.store is not None:  # the routers that were not told read it there
                    gateway.store.moved(move.key, Placement(move.replica, move.tokens),
                                        gateway.conversations.last_tip(move.key))
        gateway.migrations.reported(request.attempted, request.attempted - request.failed, request.failed,
                                    request.bytes, request.seconds)
        if request.drained:
            gateway.leaving.drained(request.drained)
        return admin_pb2.MigratedReply(applied=applied)

    async def Leaving(self, request: admin_pb2.LeavingRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.LeavingReply:
        gateway = self.gateway
        if request.replica not in gateway.fleet.endpoints or request.seconds <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Leaving: no replica {request.replica!r}, or seconds {request.seconds:g} <= 0")
        idle, in_flight = gateway.begin_leaving(request.replica, request.seconds, request.near_seconds)
        return admin_pb2.LeavingReply(idle=idle, in_flight=in_flight)

    def state(self) -> admin_pb2.State:
        gateway = self.gateway
        ledger, speeds = gateway.router.ledger, gateway.router.speeds
        return admin_pb2.State(
            routing=admin_pb2.RoutingSettings(knobs={key: toml_text(value) for key, value
                                                     in gateway.router.settings.knobs().items()}),
            replicas=[
                admin_pb2.ReplicaState(
                    name=replica.name,
                    address=replica.address,
                    healthy=replica.healthy,
                    in_flight_requests=replica.in_flight_requests,
                    in_flight_tokens=replica.in_flight_tokens,
                    **_speed_fields(speeds.speed(replica.name)),
                    answers_learnt=speeds.answers.get(replica.name, 0),
                    leaving=gateway.leaving.status(replica.name),
                )
                for replica in gateway.replica_states()
            ],
            in_flight_requests=ledger.total_requests(),
            in_flight_tokens=ledger.total_tokens(),
            decisions=sum(gateway.metrics.decisions.values()),
        )


def _speed_fields(speed: Speed) -> dict[str, float]:
    return {"prefill_tokens_per_s": 1 / speed.prefill_s_per_token, "decode_tokens_per_s": 1 / speed.decode_s_per_token,
            "request_overhead_ms": speed.overhead_s * 1000}


class MigrationService(admin_pb2_grpc.AdminServicer):
    """The Admin API as service.migration_listen serves it, to the slot sidecars of leaving
    replicas: GetState (the ring's settings), Placements and Migrated; SetRouting and Reset
    answer UNIMPLEMENTED there (the base servicer's answer), so what reaches this port can
    misplace a conversation at worst, never change the policy."""

    def __init__(self, admin: AdminService) -> None:
        self.admin = admin

    async def GetState(self, request: admin_pb2.StateRequest, context: grpc.aio.ServicerContext) -> admin_pb2.State:
        return self.admin.state()

    async def Placements(
        self, request: admin_pb2.PlacementsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PlacementsReply:
        return await self.admin.Placements(request, context)

    async def Migrated(
        self, request: admin_pb2.MigratedRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.MigratedReply:
        return await self.admin.Migrated(request, context)
