'use strict';
// The standard error details of a failed call: the google.rpc.Status a kvmesh
// server sends in the grpc-status-details-bin trailer, with its details
// (google.rpc.BadRequest for INVALID_ARGUMENT, google.rpc.RetryInfo when the
// server says how long to wait) decoded. The messages are declared here with
// the field numbers of googleapis' google/rpc/status.proto and
// error_details.proto (the fields kvmesh sends; protobufjs skips others), so
// nothing beyond protobufjs, which @grpc/proto-loader is built on, is needed.

const protobuf = require('protobufjs');

/** Trailing metadata key of the serialized google.rpc.Status. */
const STATUS_DETAILS_METADATA = 'grpc-status-details-bin';

/** Prefix of the type URL of a packed google.protobuf.Any. */
const TYPE_URL_PREFIX = 'type.googleapis.com/';

const PROTO = `
syntax = "proto3";
package google.protobuf;
message Any { string type_url = 1; bytes value = 2; }
message Duration { int64 seconds = 1; int32 nanos = 2; }
`;

const RPC_PROTO = `
syntax = "proto3";
package google.rpc;
message Status { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }
message BadRequest {
  message FieldViolation { string field = 1; string description = 2; string reason = 3; }
  repeated FieldViolation field_violations = 1;
}
message RetryInfo { google.protobuf.Duration retry_delay = 1; }
`;

const root = new protobuf.Root();
protobuf.parse(PROTO, root, { keepCase: true });
protobuf.parse(RPC_PROTO, root, { keepCase: true });
root.resolveAll();

const Status = root.lookupType('google.rpc.Status');

/** How decoded messages become plain objects: field names as in the proto, int64 as strings. */
const TO_OBJECT = { longs: String, defaults: true, arrays: true };

/** A packed detail as `{ type, ...fields }`, or `{ type, value }` (bytes) for a type not declared here. */
function unpack(any) {
  const type = any.type_url.startsWith(TYPE_URL_PREFIX)
    ? any.type_url.slice(TYPE_URL_PREFIX.length)
    : any.type_url;
  let message;
  try {
    message = root.lookupType(type);
  } catch {
    return { type, value: Buffer.from(any.value) };
  }
  return { type, ...message.toObject(message.decode(any.value), TO_OBJECT) };
}

/**
 * The google.rpc.Status of a failed call, `{ code, message, details }` with
 * each detail unpacked (see `unpack`); null when the error carries none.
 */
function richStatus(err) {
  const values = err && err.metadata ? err.metadata.get(STATUS_DETAILS_METADATA) : [];
  if (!values.length) return null;
  const status = Status.decode(values[0]);
  return { code: status.code, message: status.message, details: status.details.map(unpack) };
}

/** The field violations of an INVALID_ARGUMENT, `[{ field, description }]` (empty when none). */
function fieldViolations(err) {
  const status = richStatus(err);
  if (!status) return [];
  return status.details
    .filter((d) => d.type === 'google.rpc.BadRequest')
    .flatMap((d) => d.field_violations.map(({ field, description }) => ({ field, description })));
}

/** Milliseconds the server asks the caller to wait before retrying (RetryInfo), or null. */
function retryDelayMs(err) {
  const status = richStatus(err);
  const info = status && status.details.find((d) => d.type === 'google.rpc.RetryInfo');
  if (!info || !info.retry_delay) return null;
  return Number(info.retry_delay.seconds) * 1000 + info.retry_delay.nanos / 1e6;
}

module.exports = {
  STATUS_DETAILS_METADATA,
  richStatus,
  fieldViolations,
  retryDelayMs,
};
